"""Pass `causal_attention`: a causal mask built from constants becomes `is_causal=True`; any other mask stays.

Each graph is what Dynamo hands a backend; the pass runs alone on it, and the
rewritten graph must give the same attention. The last test takes a real
transformers Llama in its training set-up (no KV cache, so transformers builds
the mask as a tensor under Dynamo) through the whole backend.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import torch_stagehand as stagehand
from torch_stagehand.compiler import block_frames
from torch_stagehand.app.presets import tiny_llama
from torch_stagehand.compiler.context import PassLog
from torch_stagehand.compiler.passes.causal_attention import causal_attention, is_sdpa

from _helpers import rel_err

L = 16


def _capture(fn, *args, dynamic=False):
    """Dynamo's graph of `fn` and its inputs in the graph's placeholder order."""
    graphs = []

    def recording_backend(gm, inputs):  # a symbolic size comes as a SymInt: the call passes its value
        graphs.append((gm, [x.node.hint if isinstance(x, torch.SymInt) else x for x in inputs]))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=recording_backend, fullgraph=True, dynamic=dynamic)(*args)
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


@pytest.mark.parametrize("whole", [False, True], ids=["documented call", "whole model traced"])
def test_transformers_training_mask_is_dropped_and_lora_gradients_match(whole):
    """A Llama with its cache off, as in training. The documented call runs the code around the blocks eagerly:
    transformers builds no mask and every block's attention is `is_causal`. Traced whole (the blocks inlined),
    transformers builds the causal mask as a tensor under Dynamo (it cannot rule out packed sequences without
    reading the position ids) and the backend turns it back into `is_causal`. Either way the loss and LoRA
    gradients equal the plain model's, which took the `is_causal` path eagerly."""
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
    if whole:
        block_frames.frames_of(rt).remove()
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
        loss = compiled(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        notes = [m for record in rt.graph_records for m in record.changes if m.startswith("[causal_attention]")]
        if whole:
            assert any("3 attention call(s)" in m for m in notes), notes
        else:  # no mask reached a block's graph
            assert not notes and rt.stats()["compiled_graphs"] and "glue" not in "".join(rt.stats()["compiled_graphs"])
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == ref_grads.keys() and grads
        assert rel_err(loss, reference) < 1e-2
        assert max(rel_err(grads[n], ref_grads[n]) for n in grads) < 3e-2
    finally:
        rt.close()


# ---- proof from construction: symbolic lengths ---------------------------------------------------

def _bool_tril(q, k, v):
    n = q.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool).tril())


def _additive_triu(q, k, v):
    n = q.shape[-2]
    mask = torch.full((n, n), torch.finfo(q.dtype).min).triu(1)[None, None].expand(q.shape[0], 1, n, n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _arange_ge(q, k, v):
    i = torch.arange(q.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=i[:, None] >= i[None, :])


def _where_tril(q, k, v):
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, 0.0, float("-inf")))


@pytest.mark.parametrize("fn", [_hf_style_causal, _additive_causal, _bool_tril, _additive_triu, _arange_ge,
                                _where_tril], ids=["hf", "masked_fill", "tril", "triu_additive", "arange", "where"])
def test_causal_mask_of_a_symbolic_length_is_proved_and_rewritten(fn):
    q, k, v = _qkv()
    gm, inputs = _capture(fn, q, k, v, dynamic=True)
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder")
    expected = gm(*inputs)[0]
    gm, notes = _apply(gm)
    assert _attention(gm) == [(None, True)], notes
    assert "(for every length)" in notes[0]
    torch.testing.assert_close(gm(*inputs)[0], expected)


def _tril_shifted(q, k, v):
    n = q.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool).tril(1))


def _upper(q, k, v):
    n = q.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool).triu())


@pytest.mark.parametrize("fn", [_sliding_window, _tril_shifted, _upper, _bias_not_mask],
                         ids=["sliding window", "diagonal 1", "upper", "additive bias"])
def test_other_masks_of_a_symbolic_length_are_kept(fn):
    q, k, v = _qkv()
    gm, inputs = _capture(fn, q, k, v, dynamic=True)
    gm, notes = _apply(gm)
    [(mask, is_causal)] = _attention(gm)
    assert mask is not None and not is_causal, notes
    assert "kept" in notes[0]


def _flipped_twice(q, k, v):
    n = q.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool).tril().flip(0).flip(0))


def test_a_static_construction_the_proof_does_not_model_is_evaluated_instead():
    gm, inputs = _capture(_flipped_twice, *_qkv())
    expected = gm(*inputs)[0]
    gm, notes = _apply(gm)
    assert _attention(gm) == [(None, True)]
    assert "evaluated: the causal triangle" in notes[0]
    torch.testing.assert_close(gm(*inputs)[0], expected)
    gm, _ = _capture(_flipped_twice, *_qkv(), dynamic=True)
    gm, notes = _apply(gm)
    assert _attention(gm)[0][0] is not None and "symbolic sizes" in notes[0]


# ---- writes after construction --------------------------------------------------------------------

def _written_with_out(q, k, v, keep):
    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    torch.logical_and(mask, keep[0][None, :], out=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _masked_fill_inplace(q, k, v, keep):
    n = q.shape[-2]
    mask = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    mask.masked_fill_(~keep[0][None, :], float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _setitem_on_a_view(q, k, v, keep):
    n = q.shape[-2]
    base = torch.ones(n, n, dtype=torch.bool).tril()
    mask = base[None, None]
    base[:, :3] = keep[0][None, :3]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _inplace_ancestor(q, k, v, keep):
    i = torch.arange(q.shape[-2])
    j = i + 0
    mask = j[:, None] >= j[None, :]
    j.add_(keep[0].long() * 0 + 1)  # written after the mask was built from it: the mask is unaffected, but kept
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("fn", [_written_with_out, _masked_fill_inplace, _setitem_on_a_view, _inplace_ancestor],
                         ids=["out=", "masked_fill_", "setitem on the base", "ancestor written"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
def test_a_mask_written_in_place_is_kept(fn, dynamic):
    keep = torch.tensor([[False] * 3 + [True] * (L - 3)])
    gm, inputs = _capture(fn, *_qkv(), keep, dynamic=dynamic)
    expected = gm(*inputs)[0]
    gm, notes = _apply(gm)
    [(mask, is_causal)] = _attention(gm)
    assert mask is not None and not is_causal
    assert any("written in place" in n for n in notes), notes
    torch.testing.assert_close(gm(*inputs)[0], expected)


def test_mutation_index_finds_each_kind_of_write():
    from torch_stagehand.compiler.mutation import MutationIndex

    def fn(x, y):
        a = x + 1
        b = a[:, :2]       # a view of a
        b.mul_(2)          # method
        c = y * 1
        torch.add(c, 1, out=c)
        d = y + 2
        d[0] = 0           # setitem
        e = y + 3
        e += 1             # operator.iadd
        f = y + 4          # never written
        return a, c, d, e, f

    gm, _ = _capture(fn, torch.randn(4, 4), torch.randn(4, 4))
    writes = MutationIndex.of(gm.graph)
    node = {n.name: n for n in gm.graph.nodes}
    assert not writes.unplaced
    assert [w.name for w in writes.writers([node["a"]])] == ["mul_"]  # through its view b
    assert [w.name for w in writes.writers([node["b"]])] == ["mul_"]
    assert [w.name for w in writes.writers([node["c"]])] == ["add_1"]  # out=
    assert [w.target for w in writes.writers([node["d"]])] == [operator.setitem]
    assert [w.target for w in writes.writers([node["e"]])] == [operator.iadd]
    assert writes.writers([node["f"]]) == []
