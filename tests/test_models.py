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
from torch_stagehand.presets import tiny_flux, tiny_gpt2, tiny_llama

from _helpers import first_tensor, int8_reference, rel_err

peft = pytest.importorskip("peft")

MAPS = {"bf16": "bf16", "int8": "int8", "mixed": {0: "int8", 2: "int8"}}
LORA_TARGETS = {
    "llama": ["q_proj", "v_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_fc"],
    "flux": ["to_q", "to_v", "proj_mlp", "ff.net.2"],
}
BUILDERS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "flux": tiny_flux}


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
@pytest.mark.parametrize("pmap", list(MAPS))
def test_inference_matches_unmodified_model(kind, pmap):
    model, inputs = BUILDERS[kind]()
    model.requires_grad_(False)
    plain = copy.deepcopy(model)
    ref = int8_reference(model, MAPS[pmap])
    rt = stagehand.offload(model, device="cpu", precision=MAPS[pmap])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    with torch.no_grad():
        out = first_tensor(compiled(**inputs))
        stats = rt.stats()
        eager_out = first_tensor(model(**inputs))  # the same offloaded model, uncompiled
        expected, unquantized = first_tensor(ref(**inputs)), first_tensor(plain(**inputs))
    assert rel_err(out, expected) < 1e-2
    assert rel_err(eager_out, expected) < 1e-2
    if pmap == "bf16":
        assert rel_err(out, unquantized) < 1e-2
    else:
        assert 0 < rel_err(out, unquantized) < 0.1  # the quantizer's error: real, and small
    assert stats["peak_streamed_bytes"] <= stats["slots"] * stats["slot_bytes"]
    assert stats["sync_fetches"] == 0  # every compiled wait found its block prefetched


def _training_case(kind: str, pmap: str, inner: str):
    model, inputs = _with_lora(kind)
    ref = int8_reference(model, MAPS[pmap])
    ref_loss = _loss(kind, ref, inputs)
    ref_loss.backward()
    ref_grads = _lora_grads(ref)
    rt = stagehand.offload(model, device="cpu", precision=MAPS[pmap])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": inner})
    loss = _loss(kind, compiled, inputs)
    loss.backward()
    grads = _lora_grads(model)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    assert rel_err(loss, ref_loss) < 1e-2
    worst = max(rel_err(grads[k], ref_grads[k]) for k in grads)
    assert worst < 5e-2, f"worst LoRA grad rel err {worst:.3g}"
    return rt


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("pmap", list(MAPS))
def test_lora_training_matches_unmodified_model_eager_inner(kind, pmap):
    rt = _training_case(kind, pmap, "eager")
    assert rt.stats()["compiled_variants"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_lora_training_matches_unmodified_model_inductor_inner(kind):
    rt = _training_case(kind, "mixed", "inductor")
    stats = rt.stats()
    assert stats["compiled_variants"] >= 2  # a bf16 and an int8 block variant
    assert stats["peak_streamed_bytes"] <= stats["slots"] * stats["slot_bytes"]


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
