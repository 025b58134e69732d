"""Pass `causal_attention`: a causal mask built from constants becomes `is_causal=True`; any other mask stays.

Each graph is what Dynamo hands a backend; the pass runs alone on it, and the
rewritten graph must give the same attention. The last test takes a real
transformers Llama in its training set-up (no KV cache, so transformers builds
the mask as a tensor under Dynamo) through the whole backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_stagehand as stagehand
from torch_stagehand.app.presets import tiny_llama
from torch_stagehand.compiler.context import PassLog
from torch_stagehand.compiler.passes.causal_attention import causal_attention, is_sdpa

from _helpers import rel_err

L = 16


def _capture(fn, *args):
    """Dynamo's graph of `fn` and its inputs in the graph's placeholder order."""
    graphs = []

    def recording_backend(gm, inputs):
        graphs.append((gm, list(inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=recording_backend, fullgraph=True)(*args)
    return graphs[0]


def _apply(gm):
    log = PassLog()
    gm = log.run([causal_attention], gm)
    return gm, log.passes_ran[0].notes


def _attention(gm) -> list[tuple]:
    return [(n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None), n.kwargs.get("is_causal"))
            for n in gm.graph.nodes if is_sdpa(n)]


def _qkv(q_len=L, k_len=L):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 2, q_len, 8, generator=g), torch.randn(1, 2, k_len, 8, generator=g),
            torch.randn(1, 2, k_len, 8, generator=g))


def _hf_style_causal(q, k, v):
    """The shape of transformers' mask under Dynamo: aranges, index broadcasting, `le`, an and, an expand."""
    q_idx = torch.arange(q.shape[-2])[None, None, :, None]
    kv_idx = torch.arange(k.shape[-2])[None, None, None, :]
    mask = q_idx.new_ones((), dtype=torch.bool) & (kv_idx <= q_idx)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(q.shape[0], 1, -1, -1))


def _additive_causal(q, k, v):
    n = q.shape[-2]
    bias = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, bias)


@pytest.mark.parametrize("fn", [_hf_style_causal, _additive_causal], ids=["bool", "additive"])
def test_constant_causal_mask_becomes_is_causal_with_equal_output(fn):
    q, k, v = _qkv()
    gm, inputs = _capture(fn, q, k, v)
    before = len(gm.graph.nodes)
    expected = gm(*inputs)[0]
    gm, notes = _apply(gm)
    assert _attention(gm) == [(None, True)]
    assert len(gm.graph.nodes) < before  # the mask is no longer built
    assert not any(n.target is torch.arange for n in gm.graph.nodes)
    assert "became is_causal=True" in notes[0]
    torch.testing.assert_close(gm(*inputs)[0], expected)


def _padding_from_input(q, k, v, keep):
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal & keep[:, None, None, :])


def _sliding_window(q, k, v):
    i = torch.arange(q.shape[-2])
    mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _bias_not_mask(q, k, v):
    i = torch.arange(q.shape[-2]).float()
    alibi = -(i[:, None] - i[None, :]).abs() * 0.5
    return F.scaled_dot_product_attention(q, k, v, attn_mask=alibi.masked_fill(i[None, :] > i[:, None], float("-inf")))


def _causal_with_longer_keys(q, k, v):
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()  # top-left: not what a cache means
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("case", ["padding from an input", "sliding window", "additive bias", "keys longer"])
def test_any_other_mask_is_kept(case):
    fn, args = {
        "padding from an input": (_padding_from_input, (*_qkv(), torch.tensor([[True] * (L - 3) + [False] * 3]))),
        "sliding window": (_sliding_window, _qkv()),
        "additive bias": (_bias_not_mask, _qkv()),
        "keys longer": (_causal_with_longer_keys, _qkv(q_len=8, k_len=L)),
    }[case]
    gm, inputs = _capture(fn, *args)
    expected = gm(*inputs)[0]
    gm, notes = _apply(gm)
    [(mask, is_causal)] = _attention(gm)
    assert mask is not None and not is_causal
    assert "kept" in notes[0]
    torch.testing.assert_close(gm(*inputs)[0], expected)


def test_transformers_training_mask_is_dropped_and_lora_gradients_match():
    """A Llama with its cache off, as in training: under Dynamo transformers builds the causal mask as a tensor
    (it cannot rule out packed sequences without reading the position ids); the backend turns it back into
    `is_causal`, and the loss and LoRA gradients equal the plain model's, which took the `is_causal` path eagerly."""
    peft = pytest.importorskip("peft")
    model, inputs = tiny_llama(dtype=torch.float32, layers=3, batch=1, seq=24)
    model.config.use_cache = False
    model.requires_grad_(False)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    reference = model(**inputs, labels=inputs["input_ids"]).loss
    reference.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    rt = stagehand.offload(model, device="cpu", precision="bf16")
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
        loss = compiled(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        notes = [m for record in rt.graph_records for m in record.changes if m.startswith("[causal_attention]")]
        assert any("3 attention call(s)" in m for m in notes), notes
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == ref_grads.keys() and grads
        assert rel_err(loss, reference) < 1e-2
        assert max(rel_err(grads[n], ref_grads[n]) for n in grads) < 3e-2
    finally:
        rt.close()
