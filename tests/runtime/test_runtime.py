"""Runtime behaviour: host store, slots, eager path, state dicts, restore, bad input."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

import torch_stagehand as stagehand
from torch_stagehand.runtime.blocks import BlockSelectionError
from torch_stagehand.runtime.runtime import PrecisionMapError
from torch_stagehand.runtime.streamed import is_streamed

from _helpers import block_bytes_by_precision, int8_reference, rel_err, toy, two_largest_blocks


def test_offload_moves_block_linears_to_host_store_and_keeps_module_tree():
    model, x = toy()
    names_before = [n for n, _ in model.named_modules()]
    rt = stagehand.offload(model, device="cpu")
    assert rt.blocks == [f"blocks.{i}" for i in range(4)]
    assert [n for n, _ in model.named_modules()] == names_before
    assert all(is_streamed(b.up) and is_streamed(b.down) for b in model.blocks)
    assert isinstance(model.blocks[0].up, nn.Linear)  # peft/HF isinstance checks still hold
    assert not is_streamed(model.embed) and not is_streamed(model.head)
    # The module's weight is a view into the block's flat host buffer.
    buf = rt.store.buffer(0, "bf16")
    assert model.blocks[0].up.weight.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_eager_call_matches_plain_model_exactly_in_full_precision():
    model, x = toy()
    ref = copy.deepcopy(model)(x)
    stagehand.offload(model, device="cpu")
    assert torch.equal(model(x), ref)


def test_eager_int8_matches_dequantized_reference():
    model, x = toy()
    ref = int8_reference(model, "int8")(x)
    plain = copy.deepcopy(model)(x)
    stagehand.offload(model, device="cpu", precision="int8")
    out = model(x)
    assert rel_err(out, ref) < 6e-7  # measured 2.3e-7 (CPU, torch 2.13, 3 seeds)
    assert 1e-5 < rel_err(out, plain) < 1.2e-2  # INT8 is not free, but close: measured 4.6e-3 (3 seeds)


def test_eager_backward_matches_and_saves_no_weight():
    model, x = toy()
    ref_model = copy.deepcopy(model)
    xr = x.clone().requires_grad_(True)
    ref_model(xr).square().sum().backward()
    rt = stagehand.offload(model, device="cpu")
    xs = x.clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(xs)
    out.square().sum().backward()
    assert torch.equal(xs.grad, xr.grad)  # measured 0 (CPU, torch 2.13, 3 seeds): the plain model's ops
    forbidden = {rt.store.buffer(b, "bf16").untyped_storage().data_ptr() for b in range(4)}
    forbidden |= {s.buf.untyped_storage().data_ptr() for s in rt.pool.slots}
    assert saved and not any(t.untyped_storage().data_ptr() in forbidden for t in saved)


def test_slots_bound_residency_and_are_allocated_once():
    model, x = toy(n=6)
    block_bytes = block_bytes_by_precision(model)  # from the Linear shapes, not from the store or the pool
    rt = stagehand.offload(model, device="cpu")
    ptrs = [s.buf.data_ptr() for s in rt.pool.slots]
    masters = [rt.store.buffer(b, "bf16").clone() for b in range(6)]
    for _ in range(3):
        model(x)
    stats = rt.stats()
    assert stats["slots"] == 2 and stats["slot_bytes"] == max(block_bytes["bf16"])
    # Six blocks ran through two slots: at least two blocks' bytes were resident at once, never three.
    assert sum(sorted(block_bytes["bf16"])[:2]) <= stats["peak_streamed_bytes"] <= two_largest_blocks(block_bytes, "bf16")
    assert [s.buf.data_ptr() for s in rt.pool.slots] == ptrs
    assert stats["fetches"] >= 6
    # Nothing is copied back: the host masters are bit for bit what offload stored.
    assert all(torch.equal(rt.store.buffer(b, "bf16"), m) for b, m in enumerate(masters))


def test_restore_is_bit_exact_and_returns_plain_modules():
    model, x = toy(dtype=torch.bfloat16)
    model.blocks[1].up.weight.requires_grad_(True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rt = stagehand.offload(model, device="cpu", precision={0: "int8"})
    with torch.no_grad():
        model(x)
    rt.restore()
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert not any(is_streamed(m) for m in model.modules())
    assert type(model.blocks[0].up) is nn.Linear
    assert model.blocks[1].up.weight.requires_grad and not model.blocks[0].up.weight.requires_grad
    with pytest.raises(RuntimeError, match="belongs to no live runtime|closed"):
        rt.eager_linear(0, x, None)


def test_state_dict_sees_and_load_state_dict_updates_real_weights():
    model, x = toy()
    original = copy.deepcopy(model)
    rt = stagehand.offload(model, device="cpu", precision={2: "int8"})
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in original.state_dict().items())
    model(x)  # fill slots and the INT8 copy of block 2
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in sd.items()}
    model.load_state_dict(new)
    original.load_state_dict(new)
    ref = int8_reference(original, {2: "int8"})(x)
    assert rel_err(model(x), ref) < 5e-7  # stale slots dropped, INT8 re-quantized; measured 1.7e-7 (3 seeds)
    assert rt.store.blocks[0].full.data_ptr() == model.blocks[0].up.weight.data_ptr()  # still views


def test_a_trainable_streamed_weight_gets_its_gradient_on_the_host():
    """Full fine-tuning, eagerly: the streamed weight's `.grad` is a host tensor equal to the plain model's."""
    model, x = toy()
    model.requires_grad_(False)
    model.blocks[2].down.weight.requires_grad_(True)
    ref = copy.deepcopy(model)
    ref(x).square().mean().backward()
    rt = stagehand.offload(model, device="cpu")
    model(x).square().mean().backward()
    grad = model.blocks[2].down.weight.grad
    assert grad is not None and grad.device.type == "cpu"
    assert torch.equal(grad, ref.blocks[2].down.weight.grad)  # fp32 streamed: the same GEMM
    assert all(m.weight.grad is None for b in model.blocks for m in (b.up, b.down) if m is not model.blocks[2].down)
    assert rt.grads.grad_gemms == 1
    with torch.no_grad():
        model(x)  # inference computes no gradient
    assert rt.grads.grad_gemms == 1


def test_deepcopy_of_an_offloaded_model_is_refused():
    model, _ = toy()
    stagehand.offload(model, device="cpu")
    with pytest.raises(TypeError, match="deepcopy the model before offload"):
        copy.deepcopy(model)


def test_model_moves_keep_streamed_weights_on_host():
    model, x = toy()
    rt = stagehand.offload(model, device="cpu")
    model.to("meta")  # moves everything but the streamed weights
    assert model.blocks[0].up.bias.is_meta and model.embed.weight.is_meta
    assert model.blocks[0].up.weight.data_ptr() == rt.store.blocks[0].full.data_ptr()  # host master untouched
    # A dtype conversion is refused (test_freshness.py): the weights could not follow.


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


def test_bad_input_errors_name_the_problem():
    with pytest.raises(BlockSelectionError, match="no nn.ModuleList of repeated blocks in NoBlocks"):
        stagehand.offload(NoBlocks(), device="cpu")
    model, _ = toy()
    with pytest.raises(BlockSelectionError, match=r"'layers', which is not a submodule.*found: blocks"):
        stagehand.offload(model, device="cpu", blocks="layers")
    with pytest.raises(PrecisionMapError, match=r"block 7.*blocks 0..3"):
        stagehand.offload(model, device="cpu", precision={7: "int8"})
    with pytest.raises(PrecisionMapError, match="unknown precision 'fp4'"):
        stagehand.offload(model, device="cpu", precision={1: "fp4"})
    assert not any(is_streamed(m) for m in model.modules())  # failed offloads change nothing
    rt = stagehand.offload(model, device="cpu")
    with pytest.raises(PrecisionMapError, match="does not exist"):
        rt.set_precision({4: "int8"})
    with pytest.raises(PrecisionMapError, match="no block named 'blocks.9'"):
        rt.set_precision({"blocks.9": "int8"})
    with pytest.raises(RuntimeError, match="already offloaded"):
        stagehand.offload(model, device="cpu")


def test_blocks_by_fqn_list_and_by_name():
    model, x = toy(n=4)
    rt = stagehand.offload(model, device="cpu", blocks=["blocks.1", "blocks.3"])
    assert rt.blocks == ["blocks.1", "blocks.3"]
    assert is_streamed(model.blocks[1].up) and not is_streamed(model.blocks[0].up)
    rt.restore()
    rt = stagehand.offload(model, device="cpu", blocks="blocks", precision={"blocks.2": "int8"})
    assert rt.precision == {0: "bf16", 1: "bf16", 2: "int8", 3: "bf16"}


def test_phases_and_telemetry_per_step(tmp_path):
    model, x = toy()
    model.embed.requires_grad_(True)  # gradients flow back through every block
    path = tmp_path / "t.jsonl"
    rt = stagehand.offload(model, device="cpu", config=stagehand.Config(telemetry_file=str(path)))
    opt = torch.optim.SGD(model.embed.parameters(), lr=0.1)
    rt.attach(opt)
    for _ in range(3):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step_id"] for r in records] == [0, 1, 2]
    assert all(set(r["phase_durations"]) >= {"forward", "backward", "optimizer"} for r in records)
    assert all(r["h2d_bytes"] > 0 for r in records)
