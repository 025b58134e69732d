"""Real HF transformers / diffusers / peft models through the backend, on the CPU.

Outputs and LoRA gradients of the compiled, offloaded model must match the
unmodified model: bf16 maps within bf16 rounding, INT8 maps within rounding of
the model whose INT8 blocks hold the reference quantizer's dequantized weights
(and within the quantizer's error of the plain model).
"""

from __future__ import annotations

import copy

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.app.presets import tiny_flux, tiny_gpt2, tiny_llama

from _helpers import (assert_exact, block_bytes_by_precision, close, first_tensor, int8_reference, rel_err,
                      two_largest_blocks)

peft = pytest.importorskip("peft")

MAPS = {"bf16": "bf16", "int8": "int8", "mixed": {0: "int8", 2: "int8"}}
LORA_TARGETS = {
    "llama": ["q_proj", "v_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_fc"],
    "flux": ["to_q", "to_v", "proj_mlp", "ff.net.2"],
}
BUILDERS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "flux": tiny_flux}


def _whole_map(rt, pmap):
    """`pmap` naming every block: `set_precision` with a dict changes only the blocks it names, so "mixed" run
    after "int8" stayed all-int8 (against a mixed reference, 0.9% off in the output) until the rest was spelled out."""
    return pmap if isinstance(pmap, str) else {b: pmap.get(b, "bf16") for b in range(len(rt.blocks))}


def _with_lora(kind: str):
    model, inputs = BUILDERS[kind]()
    model.requires_grad_(False)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[kind], lora_dropout=0.0,
                             init_lora_weights=False, fan_in_fan_out=kind == "gpt2")
    torch.manual_seed(1)
    model = peft.get_peft_model(model, config)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float().to(torch.bfloat16)  # adapters in the model's dtype
    return model, inputs


def _loss(kind: str, model, inputs):
    if kind == "flux":
        return first_tensor(model(**inputs)).float().square().mean()
    return model(**inputs, labels=inputs["input_ids"]).loss


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_inference_matches_unmodified_model(kind):
    """One compile; every map re-links block variants (no Dynamo recompile)."""
    model, inputs = BUILDERS[kind]()
    model.requires_grad_(False)
    with torch.no_grad():
        unquantized = first_tensor(model(**inputs))
        expected = {name: first_tensor(int8_reference(model, pmap)(**inputs)) for name, pmap in MAPS.items()}
    block_bytes, bound = block_bytes_by_precision(model), 0
    rt = stagehand.offload(model, device="cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    for name, pmap in MAPS.items():
        rt.set_precision(_whole_map(rt, pmap))
        with torch.no_grad():
            out = first_tensor(compiled(**inputs))
            stats = rt.stats()
            eager_out = first_tensor(model(**inputs))  # the same offloaded model, uncompiled
        # bf16 streams the model's own weights through its own ops: measured 0; int8 and mixed 8.0e-3
        # (the dequantized weights are not rounded to bf16 here) (CPU, torch 2.13, 3 seeds)
        tol = 0 if name == "bf16" else 2e-2
        assert close(out, expected[name], tol), name
        assert close(eager_out, expected[name], tol), name
        if name == "bf16":
            assert_exact(out, unquantized)
        else:  # the quantizer's error: real, and small; measured 1.5e-2 (CPU, torch 2.13, 3 seeds)
            assert 0 < rel_err(out, unquantized) < 4e-2, name
        # Two slots: never more streamed bytes than the two largest blocks of any map run so far.
        bound = max(bound, two_largest_blocks(block_bytes, pmap))
        assert max(block_bytes["bf16"]) <= stats["peak_streamed_bytes"] <= bound, name
    assert rt.stats()["sync_fetches"] <= 3  # each eager call after a compiled one fetches its first block


def _training_matrix(kind: str, inner: str):
    """LoRA loss and gradients for every map, from one compiled model."""
    model, inputs = _with_lora(kind)
    references = {}
    for name, pmap in MAPS.items():
        ref = int8_reference(model, pmap)
        loss = _loss(kind, ref, inputs)
        loss.backward()
        references[name] = (loss.detach(), _lora_grads(ref))
    block_bytes = block_bytes_by_precision(model)
    rt = stagehand.offload(model, device="cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": inner})
    for name, pmap in MAPS.items():
        rt.set_precision(_whole_map(rt, pmap))
        for p in model.parameters():
            p.grad = None
        loss = _loss(kind, compiled, inputs)
        loss.backward()
        grads = _lora_grads(model)
        ref_loss, ref_grads = references[name]
        assert grads.keys() == ref_grads.keys() and len(grads) > 0
        # Measured over the models (CPU, torch 2.13, 3 seeds). Eager inner: bf16 0 (the plain model's own ops);
        # int8 and mixed: loss 6.4e-4, worst LoRA grad 3.8e-2 (INT8 blocks skip the bf16 rounding of the
        # dequantized weights). Inductor: loss 2.7e-3, worst grad 4.4e-2 (bf16 alone 3.2e-2).
        exact = inner == "eager" and name == "bf16"
        assert close(loss, ref_loss, 0 if exact else (1.8e-3 if inner == "eager" else 7e-3)), name
        worst = max(rel_err(grads[k], ref_grads[k]) for k in grads)
        assert (worst == 0) if exact else (worst < 8e-2), f"{name}: worst LoRA grad rel err {worst:.3g}"
    stats = rt.stats()
    assert stats["compiled_variants"] >= 2  # at least a bf16 and an int8 block variant
    # bf16 ran first and is the largest: two slots hold at most its two largest blocks.
    assert max(block_bytes["bf16"]) < stats["peak_streamed_bytes"] <= two_largest_blocks(block_bytes, "bf16")
    return rt


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_lora_training_matches_unmodified_model_eager_inner(kind):
    _training_matrix(kind, "eager")


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_lora_training_matches_unmodified_model_inductor_inner(kind):
    _training_matrix(kind, "inductor")


def test_peft_lora_llama_precision_switch_and_back_compiles_nothing():
    model, inputs = _with_lora("llama")
    rt = stagehand.offload(model, device="cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    _loss("llama", compiled, inputs).backward()
    rt.set_precision({1: "int8", 3: "int8"})
    _loss("llama", compiled, inputs).backward()
    before = rt.stats()["compiled_variants"]
    rt.set_precision("bf16")
    _loss("llama", compiled, inputs).backward()
    rt.set_precision({1: "int8", 3: "int8"})
    _loss("llama", compiled, inputs).backward()
    assert rt.stats()["compiled_variants"] == before  # the first switch compiled the int8 variants; this one none


def test_activation_checkpointing_is_correct_and_streams_ahead_in_both_directions():
    """HF gradient checkpointing: the recomputed forward runs inside backward."""
    model, inputs = _with_lora("llama")
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ref = copy.deepcopy(model)
    ref_loss = _loss("llama", ref, inputs)
    ref_loss.backward()
    rt = stagehand.offload(model, device="cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    loss = _loss("llama", compiled, inputs)
    loss.backward()
    grads, ref_grads = _lora_grads(model), _lora_grads(ref)
    assert_exact(loss, ref_loss)  # measured 0 (CPU, torch 2.13, 3 seeds): the plain model's bf16 forward
    assert max(rel_err(grads[k], ref_grads[k]) for k in grads) < 4e-2  # measured 1.4e-2 (CPU, torch 2.13, 3 seeds)
    stats = rt.stats()
    assert stats["sync_fetches"] <= 1  # only the very first block; the recompute prefetches backwards
    assert rt.phases.phase.value == "backward" and stats["steps"] == 0  # recompute did not start a step


def test_peft_lora_llama_over_changing_sequence_lengths_compiles_blocks_once_for_all():
    """An LLM fine-tune sees many lengths: the second one makes them dynamic, later ones compile nothing."""
    model, _ = _with_lora("llama")
    rt = stagehand.offload(model, device="cpu", precision="int8")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    gen = torch.Generator().manual_seed(3)
    variants = []
    for seq in (16, 24, 40):
        inputs = {"input_ids": torch.randint(0, 256, (2, seq), generator=gen)}
        for p in model.parameters():
            p.grad = None
        loss = _loss("llama", compiled, inputs)
        loss.backward()
        grads = _lora_grads(model)
        variants.append(rt.stats()["compiled_variants"])
        rt_state = rt.precision  # the reference: the same offloaded model, run eagerly (no compile)
        for p in model.parameters():
            p.grad = None
        ref_loss = _loss("llama", model, inputs)
        ref_loss.backward()
        ref_grads = _lora_grads(model)
        assert rt.precision == rt_state
        # the same offloaded model and ops, compiled or not: measured 0 at each length (CPU, torch 2.13, 3 seeds)
        assert_exact(loss, ref_loss, msg=f"length {seq}")
        for k in ref_grads:
            assert_exact(grads[k], ref_grads[k], msg=f"length {seq}: {k}")
    assert variants[2] == variants[1] > variants[0]  # length 40 compiled no block variant
