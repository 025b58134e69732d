"""Per-layer granularity: a block's attention and MLP layers in different precisions.

By-role precisions ("int8-mlp": attention bf16, MLP int8) stream one buffer per block
whose layers carry their own precision's layout; the policy with granularity "layer"
scores and switches a block's attention and MLP apart.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.app.presets import tiny_llama
from torch_stagehand.config import Config
from torch_stagehand.kernels import dequantize, quantize_per_row
from torch_stagehand.runtime.blocks import find_blocks, streamed_layers
from torch_stagehand.runtime.precision.by_role import layer_role
from torch_stagehand.runtime.selective.units import Units

from _helpers import first_tensor, lora_llama, rel_err, sp_config, train_sgd


def quantized_roles(model, block: int, role: str):
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for spec in streamed_layers(ref, find_blocks(ref)):
            if spec.block == block and layer_role(spec.fqn) == role:
                q, s = quantize_per_row(spec.module.weight.detach(), method="mse")
                spec.module.weight.copy_(dequantize(q, s, torch.float32).to(spec.module.weight.dtype))
    return ref


@pytest.mark.parametrize("role", ["mlp", "attn"])
def test_a_by_role_precision_quantizes_only_that_role(role):
    model, inputs = tiny_llama(dtype=torch.float32)
    model.requires_grad_(False)
    with torch.no_grad():
        expected = first_tensor(quantized_roles(model, 1, role)(**inputs))
        whole_block = first_tensor(quantized_roles(quantized_roles(model, 1, "mlp"), 1, "attn")(**inputs))
    rt = stagehand.offload(model, device="cpu", precision={1: f"int8-{role}"})
    n_bf16, n_int8, n_mixed = (rt.block_nbytes(1, p) for p in ("bf16", "int8", f"int8-{role}"))
    assert n_int8 < n_mixed < n_bf16
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    with torch.no_grad():
        out = first_tensor(compiled(**inputs))
    assert rel_err(out, expected) < 9e-7  # measured 2.9e-7 (CPU, torch 2.13, 3 seeds)
    assert rel_err(out, whole_block) > 1e-4  # the other role really stayed full precision


def test_units_map_blocks_to_attention_and_mlp_and_back():
    units = Units(2, per_layer=True)
    assert units.unit_map({0: "int8-mlp", 1: "fp8"}) == {0: "bf16", 1: "int8", 2: "fp8", 3: "fp8"}
    assert units.block_map({0: "int8", 1: "bf16", 2: "bf16", 3: "bf16"}) == {0: "int8-attn", 1: "bf16"}
    assert units.block_map(units.unit_map({0: "fp8-attn", 1: "int8"})) == {0: "fp8-attn", 1: "int8"}
    assert [units.label(u) for u in range(4)] == ["0.attn", "0.mlp", "1.attn", "1.mlp"]
    assert Units(2, per_layer=False).block_map({0: "int8", 1: "bf16"}) == {0: "int8", 1: "bf16"}


def test_granularity_layer_switches_a_blocks_attention_and_mlp_apart(tmp_path):
    model, inputs = lora_llama()
    rt = stagehand.offload(model, device="cpu", config=sp_config(tmp_path, granularity="layer",
                                                                 force_bf16_blocks=[3]))
    params = rt.selective.units.params(model, rt.blocks)
    assert len(params) == 8 and all(params[u] for u in range(8))  # q/v adapters in attention, up/down in MLP
    torch._dynamo.reset()
    train_sgd(model, inputs, rt, steps=4)
    units = rt.selective.units.unit_map(rt.precision)
    assert any(p == "int8" for p in units.values())
    assert units[6] == units[7] == "bf16"  # the force list holds both of block 3's units
    assert rt.selective.stats.read().steps == 2 and len(rt.selective.stats.read().l2) == 8


def test_units_with_both_roles_low_in_different_precisions_map_to_one_by_role_precision():
    units = Units(1, per_layer=True)
    assert units.block_map({0: "int8", 1: "fp8"}) == {0: "int8-attn+fp8-mlp"}
    assert units.block_map({0: "fp8", 1: "int8"}) == {0: "fp8-attn+int8-mlp"}
    assert units.unit_map({0: "int8-attn+fp8-mlp"}) == {0: "int8", 1: "fp8"}


def test_a_by_role_precision_needs_two_stored_dtypes():
    from torch_stagehand.runtime import precision as precisions
    from torch_stagehand.runtime.precision.by_role import ByRole

    with pytest.raises(ValueError, match="store the same dtype"):
        ByRole("int8-attn+int8-mlp", 99, attention=precisions.get("int8"), mlp=precisions.get("int8"))


def fp8_dequantized_roles(model, block: int, role: str):
    from torch_stagehand.runtime.precision.fp8 import dequantize_rows_e4m3, quantize_rows_e4m3

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for spec in streamed_layers(ref, find_blocks(ref)):
            if spec.block == block and layer_role(spec.fqn) == role:
                q, s = quantize_rows_e4m3(spec.module.weight.detach())
                spec.module.weight.copy_(dequantize_rows_e4m3(q, s, spec.module.weight.dtype))
    return ref


def test_attention_int8_and_mlp_fp8_in_one_block_compute_what_each_stores():
    """"int8-attn+fp8-mlp" (fp8 emulated on the CPU): one buffer of one byte per weight, each layer computed
    by the precision that stored it."""
    model, inputs = tiny_llama(dtype=torch.float32)
    model.requires_grad_(False)
    with torch.no_grad():
        expected = first_tensor(fp8_dequantized_roles(quantized_roles(model, 1, "attn"), 1, "mlp")(**inputs))
        all_int8 = first_tensor(quantized_roles(quantized_roles(model, 1, "attn"), 1, "mlp")(**inputs))
    config = Config.from_dict({"selective_precision": {"fp8_emulate": True}})
    rt = stagehand.offload(model, device="cpu", precision={1: "int8-attn+fp8-mlp"}, config=config, verbose=False)
    assert rt.block_nbytes(1, "int8-attn+fp8-mlp") == rt.block_nbytes(1, "int8")  # a byte a weight either way
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    with torch.no_grad():
        out = first_tensor(compiled(**inputs))
    assert rel_err(out, expected) < 9e-7  # measured 3.1e-7 (CPU, torch 2.13, 3 seeds)
    assert rel_err(out, all_int8) > 1e-4  # the MLP really is fp8
    rt.restore()


def test_the_fp8_policy_file_picks_fp8_per_role_where_only_the_mlp_was_measured_faster(tmp_path):
    from torch_stagehand.runtime.selective import fp8_rules

    model, inputs = lora_llama()
    mlp_shapes = {(s.out_features, s.in_features) for s in streamed_layers(model, find_blocks(model))
                  if layer_role(s.fqn) == "mlp"}
    attn_shapes = {(s.out_features, s.in_features) for s in streamed_layers(model, find_blocks(model))
                   if layer_role(s.fqn) == "attn"}
    assert not mlp_shapes & attn_shapes  # the rules tell the roles apart
    path = str(tmp_path / "fp8.json")
    fp8_rules.save(fp8_rules.Fp8Policy("cpu", 1.0, [fp8_rules.Fp8Rule(n, k, 64, 1.3) for n, k in mlp_shapes]), path)
    for granularity, lows in [("layer", ["int8", "fp8"]), ("block", ["int8"])]:
        model, inputs = lora_llama()
        rt = stagehand.offload(model, device="cpu", verbose=False, config=sp_config(
            tmp_path, granularity=granularity, fp8_policy_file=path, fp8_tokens=1024, fp8_emulate=True))
        sel = rt.selective
        assert [sel.low_for_unit(u) for u in range(len(lows))] == lows
        assert sel.low_for(0) == ("int8-attn+fp8-mlp" if granularity == "layer" else "int8")
        units = len(sel.units)
        new, _ = sel.policy.update(10, sel.units.unit_map(rt.precision), [0.0] * units)  # every unit goes down
        assert sel.units.block_map(new)[0] == sel.low_for(0)
        rt.restore()
