"""On a CUDA device: the VRAM-budget plan calibrates, re-plans, stays under its budget, and shrinks its
plan when the device has less memory than the budget promised (a per-process memory fraction).

Run on the device machine with `pytest -m gpu tests/runtime/conductor/test_gpu_budget.py`; skipped without CUDA.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import torch_stagehand as stagehand

from _helpers import page_locked, rel_err, square_loss_step, toy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, D = 8, 1024


def _trainable():
    model, x = toy(d=D, n=N)
    for block in model.blocks:
        block.norm.requires_grad_(True)
    return model, x.cuda().repeat(4, 64, 1)


_step = square_loss_step


@pytest.mark.parametrize("budget_blocks", [2.5, 5, 100])
def test_budget_plan_calibrates_replans_and_stays_under_its_budget(budget_blocks):
    model, x = _trainable()
    ref_model = copy.deepcopy(model).cuda()
    ref_out, ref_grads = _step(ref_model, ref_model, x)
    del ref_model
    block_bytes = 2 * D * 2 * D * 4  # up + down, fp32
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    budget = base + int(budget_blocks * block_bytes) + 256 * 2**20  # room for activations and the glue
    rt = stagehand.offload(model, device="cuda", vram_budget=budget)
    assert rt.plan.kind == "calibrating"
    # An attached optimizer ends each step at its step() (without one, a step ends only when the
    # next forward begins, so the measured step would not be over yet). lr=0: the weights stay.
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    rt.attach(optimizer)
    compiled = torch.compile(model, backend="stagehand", options={"inner": "inductor"})
    torch._dynamo.reset()
    for _ in range(2):  # warm-up (compile), then the measured step
        _step(compiled, model, x)
        optimizer.step()
    assert rt.plan.kind == "planned" and rt.plan_driver.calibrated
    # The made plan's predicted peak is held by the allocator before its first step (planning.reserve_for_plan).
    assert torch.cuda.memory_reserved() >= min(rt.plan.predicted_peak_bytes, budget) - (64 << 20)
    measured = rt.plan_driver.cost_model
    assert measured.forward_s and all(t > 0 for t in measured.forward_s)
    assert all(a >= i for a, i in zip(measured.activation_bytes, measured.input_bytes))
    _step(compiled, model, x)  # the new plan's variants compile
    optimizer.step()  # ends the plan's first step: its peak was measured against the prediction
    assert rt.plan.measured_peak_bytes is not None or rt.stats()["plan_corrections"], rt.plan.summary()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out, grads = _step(compiled, model, x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert rel_err(out, ref_out) < 1e-4 and max(rel_err(grads[k], ref_grads[k]) for k in grads) < 1e-4
    assert peak <= budget, (peak, budget, rt.plan.summary())
    if budget_blocks == 100:
        assert rt.stats()["resident_blocks"] == N
    print(rt.plan, f"\npeak {peak / 2**20:.1f} MiB of {budget / 2**20:.1f} MiB")


def test_reserve_holds_the_shortfall_in_the_allocators_cache_and_allocates_nothing():
    # allocator.reserve: what a made plan's first step would map piece by piece is held (cached, free) when the
    # plan is applied; a target already held maps nothing.
    from torch_stagehand.runtime.device.allocator import reserve

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    allocated, before = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    target = before + (256 << 20)
    added, seconds = reserve(device, target)
    assert added >= 256 << 20 and seconds > 0
    assert torch.cuda.memory_reserved(device) >= target and torch.cuda.memory_allocated(device) == allocated
    assert reserve(device, target) == (0, 0.0)
    torch.cuda.empty_cache()


def test_a_memory_fraction_below_the_budget_shrinks_the_plan_and_says_so(caplog):
    model, x = _trainable()
    x = x[:2, :16].contiguous()  # small activations: the cap below is about the weights
    total = torch.cuda.get_device_properties(0).total_memory
    # The earlier tests' runtimes must be gone before the room is measured: one collected later,
    # during the offload below, would hand its memory back inside the cap and nothing would shrink.
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    used = torch.cuda.memory_reserved()
    # Room for four blocks' weights beyond what is in use (the two slots included): all eight
    # resident (six more than the slots' two) cannot fit, so the planned plan must shrink.
    cap = used + 4 * 2 * D * 2 * D * 4
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        rt = stagehand.offload(model, device="cuda", vram_budget=total)  # promises the whole device
        rt.replan(stagehand.runtime_of(model).plan_driver.cost_model.with_(frozen=True))
        assert rt.plan_driver.shrinks and "budget shrunk" in rt.plan_driver.shrinks[0]
        assert rt.stats()["resident_blocks"] < N
        compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
        torch._dynamo.reset()
        _step(compiled, model, x)  # the step completes under the shrunk plan
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_spilled_activations_cross_pcie_both_ways_and_give_the_same_gradients(inner):
    from torch_stagehand.runtime.conductor.costs import CostModel

    model, x = _trainable()
    ref_model = copy.deepcopy(model).cuda()
    ref_out, ref_grads = _step(ref_model, ref_model, x)
    del ref_model
    block_bytes = 2 * D * 2 * D * 4
    rt = stagehand.offload(model, device="cuda", vram_budget=torch.cuda.memory_allocated() + 3 * block_bytes + 2**30)
    # Injected: a slow forward and a fast link, so the plan spills instead of recomputing.
    rt.replan(CostModel(h2d_bps=1e12, d2h_bps=1e12, forward_s=[1.0] * N, activation_bytes=[2**28] * N,
                        input_bytes=[2**20] * N, base_bytes=torch.cuda.memory_allocated(), frozen=True))
    assert rt.plan.spilled
    compiled = torch.compile(model, backend="stagehand", options={"inner": inner})
    torch._dynamo.reset()
    for _ in range(2):
        out, grads = _step(compiled, model, x)
    torch.cuda.synchronize()
    assert rel_err(out, ref_out) < 1e-4 and max(rel_err(grads[k], ref_grads[k]) for k in grads) < 1e-4
    stats = rt.stats()
    assert stats["d2h_bytes"] > 0 and stats["restored_bytes"] == stats["d2h_bytes"]
    assert all(page_locked(buf) for bufs in rt.plan_driver.spill._free.values() for buf in bufs)
