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

from _helpers import first_tensor, rel_err
from test_selective_training import lora_llama, sp_config, train


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
    assert rel_err(out, expected) < 1e-5
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
    train(model, inputs, rt, steps=4)
    units = rt.selective.units.unit_map(rt.precision)
    assert any(p == "int8" for p in units.values())
    assert units[6] == units[7] == "bf16"  # the force list holds both of block 3's units
    assert rt.selective.stats.read().steps == 2 and len(rt.selective.stats.read().l2) == 8
