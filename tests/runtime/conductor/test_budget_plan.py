"""The runtime acts on the plan: resident blocks, slots, lookahead, recompute; same numbers in every plan.

On the CPU the budget bounds the device copy of the streamed weights (the resident
blocks' own slots plus the rotating slots), so these tests drive the planner through
`offload(vram_budget=...)` with real models and check what the pool did.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.config import Config, ConductorConfig
from torch_stagehand.runtime.conductor.costs import BudgetError, CostModel
from torch_stagehand.runtime.conductor import trace as tr
from torch_stagehand.runtime.conductor.trace import recording

from _helpers import block_bytes_by_precision, close, rel_err, toy

N = 6


def _model():
    model, x = toy(n=N)
    for block in model.blocks:
        block.norm.requires_grad_(True)
    return model, x.requires_grad_(True)


def _step(call, model, x):
    for p in model.parameters():
        p.grad = None
    x.grad = None
    out = call(x)
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, x.grad.clone()


def _same(a, b, inner="eager"):
    # Eagerly or with the eager inner compiler every plan runs the plain model's own ops: bitwise equal
    # (measured 0). Inductor fuses and reorders: measured 3.8e-7 (out, dx) and 5.1e-7 (grads)
    # (CPU, torch 2.13, 3 seeds).
    tol, grad_tol = (0, 0) if inner == "eager" else (1e-6, 1.5e-6)
    out_a, grads_a, dx_a = a
    out_b, grads_b, dx_b = b
    assert close(out_a, out_b, tol) and close(dx_a, dx_b, tol)
    assert grads_a.keys() == grads_b.keys() and grads_a
    assert all(close(grads_a[k], grads_b[k], grad_tol) for k in grads_a)


def _block_bytes():
    return block_bytes_by_precision(toy(n=N)[0])["bf16"][0]  # every toy block is the same size (fp32 here)


def _budget(name: str) -> int:
    b = _block_bytes()
    return {"everything": N * b, "half": 5 * b, "tiny": 2 * b}[name]


@pytest.mark.parametrize("budget", ["everything", "half", "tiny"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_every_plan_gives_the_plain_models_outputs_and_gradients(budget, mode):
    model, x = _model()
    plain = copy.deepcopy(model)
    ref = _step(plain, plain, x)
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget(budget))
    torch._dynamo.reset()
    call = model if mode == "eager" else torch.compile(model, backend="stagehand", options={"inner": "eager"})
    for _ in range(2):
        _same(_step(call, model, x), ref)
    stats = rt.stats()
    assert stats["streamed_device_bytes"] <= _budget(budget)
    assert stats["peak_streamed_bytes"] <= _budget(budget)
    resident = stats["resident_blocks"]
    assert resident == len(rt.plan.resident)
    assert {"everything": resident == N, "half": 0 < resident < N, "tiny": resident == 0}[budget]


def test_a_budget_that_fits_everything_moves_no_bytes_after_offload():
    model, x = _model()
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("everything"))
    assert rt.plan.slots == 0 and len(rt.pool.slots) == 0
    filled = rt.stats()["h2d_bytes"]
    assert filled == N * _block_bytes()  # each resident block copied in once, at offload
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    torch._dynamo.reset()
    for _ in range(2):
        _step(compiled, model, x)
    stats = rt.stats()
    assert stats["h2d_bytes"] == filled and stats["sync_fetches"] == 0
    assert stats["streamed_device_bytes"] == N * _block_bytes()
    print(rt.plan)


def test_resident_blocks_are_never_fetched_and_lookahead_skips_over_them():
    model, x = _model()
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("half"))
    resident = rt.plan.resident
    assert 0 < len(resident) < N and rt.plan.slots >= 1
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    torch._dynamo.reset()
    _step(compiled, model, x)
    with recording(rt.pool) as trace:
        _step(compiled, model, x)
    copied = {r.block for r in trace.rows if r.copied}
    assert copied and not copied & resident
    # Every streamed block's wait found its copy issued ahead (the prefetch skipped the resident
    # blocks to fetch it) except the step's very first block, which nothing runs before.
    waits = [r for r in trace.rows if r.action == tr.WAIT and r.block not in resident]
    assert [r.outcome for r in waits].count(tr.SYNC_FETCH) <= 1


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_small_budget_with_measured_activations_recomputes_in_the_compiled_program(inner):
    model, x = _model()
    plain = copy.deepcopy(model)
    ref = _step(plain, plain, x)
    b = _block_bytes()
    rt = stagehand.offload(model, device="cpu", vram_budget=b + 3 * 4096)
    # Injected constants: each block keeps 4 KiB of activations or 1 KiB of inputs; the budget leaves
    # room for one slot and 12 KiB of activations (keeping all needs 24), so blocks must recompute.
    rt.replan(CostModel(activation_bytes=[4096] * N, input_bytes=[1024] * N, frozen=True))
    assert rt.plan.resident == set() and rt.plan.slots == 1 and len(rt.plan.recomputed) >= 3
    assert rt.stats()["planned_recompute_blocks"] == len(rt.plan.recomputed)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": inner})
    _same(_step(compiled, model, x), ref, inner)
    recomputed = rt.stats()["recomputed_blocks"]
    assert recomputed == len(rt.plan.recomputed)
    # A budget with room for everything keeps every activation: the next step recomputes nothing.
    rt.plan_driver.budget = type(rt.plan_driver.budget)(soft=100 * b, hard=100 * b)
    rt.replan()
    assert rt.plan.recomputed == set() and rt.plan.resident == set(range(N))
    _same(_step(compiled, model, x), ref, inner)
    assert rt.stats()["recomputed_blocks"] == recomputed


def test_a_resident_block_sees_writes_to_its_weights():
    model, x = _model()
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("everything"))
    with torch.no_grad():
        before = model(x)
        model.blocks[2].up.weight.mul_(2.0)  # in place on the host master
        after = model(x)
    assert rel_err(after, before) > 1e-3  # the write reached the resident copy
    assert rt.stats()["stale_slots"] >= 1
    restored = copy.deepcopy(rt.restore())
    with torch.no_grad():
        assert torch.equal(restored(x), after)  # measured 0 (CPU, torch 2.13, 3 seeds): the same weights and ops


def test_a_precision_switch_replans():
    model, x = toy(n=N)
    sizes = block_bytes_by_precision(model)
    budget = 3 * sizes["bf16"][0]
    rt = stagehand.offload(model, device="cpu", vram_budget=budget)
    bf16_resident = len(rt.plan.resident)
    rt.set_precision("int8")
    assert len(rt.plan.resident) > bf16_resident  # blocks are a quarter the bytes now
    assert rt.stats()["streamed_device_bytes"] <= budget
    with torch.no_grad():
        model(x)


def test_budgets_from_the_config_and_their_errors():
    b = _block_bytes()
    model, _ = toy(n=N)
    config = Config(conductor=ConductorConfig(vram_soft_cap_mb=N * b / 2**20, vram_hard_cap_mb=N * b / 2**20))
    rt = stagehand.offload(model, device="cpu", config=config)
    assert rt.plan.kind == "planned" and len(rt.plan.resident) == N
    rt.restore()
    with pytest.raises(BudgetError, match="vram_budget"):
        stagehand.offload(model, device="cpu", vram_budget="plenty")
    with pytest.raises(BudgetError, match="above conductor.vram_hard_cap_mb"):
        stagehand.offload(model, device="cpu", vram_budget=10 * N * b, config=config)
    with pytest.raises(BudgetError, match="no plan fits"):
        stagehand.offload(model, device="cpu", vram_budget=b // 2)
    assert not any(type(m).__name__.startswith("Streamed") for m in model.modules())  # offload undone


def test_no_budget_runs_the_fixed_two_slot_plan():
    model, x = toy(n=N)
    rt = stagehand.offload(model, device="cpu")
    assert rt.plan.kind == "fixed" and rt.plan.slots == 2 and rt.plan.resident == set()
    assert rt.stats()["resident_blocks"] == 0 and rt.plan.recompute_of(0) is None


def test_a_precision_switch_between_forward_and_backward_with_every_block_resident():
    model, x = _model()
    plain = copy.deepcopy(model)
    ref = _step(plain, plain, x)
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("everything"))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    x.grad = None
    out = compiled(x)
    rt.set_precision("int8")  # re-plans: the resident copies are INT8 now, and no slot rotates
    assert len(rt.pool.slots) == 0 and len(rt.plan.resident) == N
    out.float().square().mean().backward()  # the backward runs in the forward's precision: a slot is added
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    _same((out.detach(), grads, x.grad), ref)
    assert len(rt.pool.slots) == 1


def test_explain_and_the_schedule_command_print_the_plan():
    model, x = toy(n=N)
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("half"))
    torch._dynamo.reset()
    with torch.no_grad():
        report = stagehand.explain(model, x)
    assert report.plan is rt.plan
    table = report.plan_table()
    assert "planned plan" in table and "H2D MiB this call" in table and table in str(report)
    resident_rows = [line for line in table.splitlines() if " resident " in line]
    assert len(resident_rows) == len(rt.plan.resident)
    assert all(float(line.split()[-1]) == 0 for line in resident_rows)  # resident blocks moved nothing this call
    streamed_rows = [line for line in table.splitlines() if " streamed " in line]
    assert any(float(line.split()[-1]) > 0 for line in streamed_rows)


def test_a_refused_budget_leaves_the_plan_and_the_budget_in_force():
    model, x = _model()
    plain = copy.deepcopy(model)
    ref = _step(plain, plain, x)
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("half"))
    plan, budget = rt.plan, rt.plan_driver.budget
    with pytest.raises(BudgetError, match="no plan fits"):
        rt.replan(vram_budget=_block_bytes() // 2)
    # the conductor's pressure rules read the budget: a refused one must not tighten them
    assert rt.plan is plan and rt.plan_driver.budget == budget
    _same(_step(model, model, x), ref)


def test_a_measured_peak_over_the_prediction_corrects_the_cost_model_and_replans_under_the_budget():
    model, x = _model()
    plain = copy.deepcopy(model)
    ref = _step(plain, plain, x)
    b = _block_bytes()
    budget = _budget("everything")
    rt = stagehand.offload(model, device="cpu", vram_budget=budget)
    plan = rt.plan
    assert len(plan.resident) == N and plan.predicted_peak_bytes <= budget
    rt.plan_driver._check_peak(step=1, peak=plan.predicted_peak_bytes - 1)  # under the prediction: nothing to learn
    assert rt.plan is plan and rt.plan_driver.cost_model.base_bytes == 0 and plan.measured_peak_bytes is not None
    rt.plan_driver._check_peak(step=2, peak=plan.predicted_peak_bytes + 2 * b)  # the step held two blocks more
    assert rt.plan_driver.cost_model.base_bytes == 2 * b
    assert rt.plan is not plan and len(rt.plan.resident) < N
    # the corrected prediction fits again, with the miss as a margin: a new plan's first step is not
    # checked before it runs, and the hard cap is never to be crossed
    assert rt.plan_driver.peak_margin == 2 * b and rt.plan.predicted_peak_bytes <= budget - 2 * b
    assert rt.plan.budget.soft == budget and "MiB under the budget" in rt.plan.notes[-1]
    notes = rt.stats()["plan_corrections"]
    assert len(notes) == 1 and "over the plan's prediction" in notes[0] and "re-planned" in notes[0]
    _same(_step(model, model, x), ref)


def test_a_plan_that_does_not_fit_when_applied_shrinks_the_budget_and_says_so(monkeypatch):
    model, x = _model()
    plain = copy.deepcopy(model)
    ref = _step(plain, plain, x)
    b = _block_bytes()
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("half"))
    real = rt.pool.reconfigure

    def device_with_room_for_three_blocks(n_slots, slot_bytes, resident):
        if n_slots * slot_bytes + len(resident) * b > 3 * b:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(n_slots, slot_bytes, resident)

    monkeypatch.setattr(rt.pool, "reconfigure", device_with_room_for_three_blocks)
    rt.replan(vram_budget=_budget("everything"))
    assert rt.plan_driver.shrinks and "budget shrunk" in rt.plan_driver.shrinks[-1]
    assert rt.stats()["streamed_device_bytes"] <= 3 * b
    _same(_step(model, model, x), ref)


@pytest.mark.parametrize("reserved_over_budget", [False, True])
def test_calibration_measures_a_step_under_the_smallest_plan_then_plans_for_real(reserved_over_budget, monkeypatch):
    # After calibration the allocator's cache is handed back only when it holds more than the budget.
    emptied = []
    monkeypatch.setattr(torch.cuda, "memory_reserved",
                        lambda device=None: (2 if reserved_over_budget else 0) * _budget("half"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    model, x = _model()
    plain = copy.deepcopy(model)
    ref = _step(plain, plain, x)
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("half"))
    rt.plan_driver.calibrated = False  # on the CPU the defaults stand unless asked; the GPU always calibrates
    rt.replan()
    assert rt.plan.kind == "calibrating" and rt.plan.recomputed == set(range(N)) and rt.plan.slots == 2
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    rt.attach(optimizer)
    for step in range(3):  # warm-up, measured, then the plan made from the measurements
        _same(_step(compiled, model, x), ref)
        optimizer.step()
        assert rt.plan.kind == ("calibrating" if step == 0 else "planned")
    measured = rt.plan_driver.cost_model
    assert rt.plan_driver.calibrated and "calibration_step_s" in measured.measured
    assert len(measured.forward_s) == N and all(t > 0 for t in measured.forward_s + measured.backward_s)
    assert rt.stats()["recomputed_blocks"] >= 2 * N  # the two calibration steps recomputed every block
    assert rt.plan.predicted_step_s > 0 and 0 < len(rt.plan.resident) < N
    assert bool(emptied) == reserved_over_budget


def test_a_calibration_step_that_compiled_units_is_measured_again_on_the_next_step():
    """A unit compiled or loaded in the measured step (here: a second input shape's; with ahead-compile workers,
    the first compiled forward's) puts one-time seconds in the step's times: the smallest plan runs one more
    step, measured instead, and the plan is made from that one."""
    model, x = _model()
    other = x[:1].detach().clone().requires_grad_(True)  # another batch size: new units in the measured step
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("half"))
    rt.plan_driver.calibrated = False  # on the CPU the defaults stand unless asked; the GPU always calibrates
    rt.replan()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    rt.attach(optimizer)
    kinds, units = [], []
    for step, batch in enumerate([x, other, x, x]):
        before = rt.compile_count
        _step(compiled, model, batch)
        optimizer.step()
        kinds.append(rt.plan.kind)
        units.append(rt.compile_count - before)
    assert units[1] > 0 and units[2] == 0  # step 1 compiled the other shape's units; step 2 nothing
    assert kinds == ["calibrating", "calibrating", "planned", "planned"]
    assert rt.stats()["calibration_remeasured"] == [1]
    assert rt.plan_driver.calibrated and "calibration_step_s" in rt.plan_driver.cost_model.measured
    # Every unit compiled ran, and its first run was counted once (a calibration step that holds a unit's first
    # run, whose kernels load and tune then, is measured again too).
    assert rt.stats()["units_first_run"] == rt.compile_count > 0


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_spilled_activations_come_back_for_the_backward_with_the_same_gradients(inner):
    model, _ = _model()
    x = torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(3)).requires_grad_(True)  # 128 KiB activations
    plain = copy.deepcopy(model)
    ref = _step(plain, plain, x)
    b = _block_bytes()
    rt = stagehand.offload(model, device="cpu", vram_budget=2 * b + 2**20)
    # Injected constants: keeping every block's 1 MiB of activations does not fit; a spill costs less than
    # a recompute (a slow forward, a fast link), so blocks spill.
    rt.replan(CostModel(h2d_bps=1e12, d2h_bps=1e12, forward_s=[1.0] * N, activation_bytes=[2**20] * N,
                        input_bytes=[2**16] * N, frozen=True))
    assert rt.plan.spilled and not rt.plan.recomputed
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": inner})
    for _ in range(2):
        _same(_step(compiled, model, x), ref, inner)
    stats = rt.stats()
    assert stats["spilled_blocks"] == len(rt.plan.spilled) and stats["recomputed_blocks"] == 0
    assert stats["d2h_bytes"] > 0 and stats["restored_bytes"] == stats["d2h_bytes"]


def test_later_plans_measure_the_blocks_again_and_keep_the_smaller_times():
    """The calibration step's spans read high (a full launch queue holds the host back; a slow host leaves
    the GPU waiting inside a block); the first REFINE_STEPS steps of each later plan measure host and GPU
    time again, per kind and block, and the smaller value stays for the next plan made. The plan running
    keeps its prediction; a later step changes nothing."""
    from torch_stagehand.runtime.conductor.driver import REFINE_STEPS

    model, x = _model()
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("half"))
    slow = 10.0  # seconds per block: what a held-back host might have read
    rt.replan(CostModel(host_s={k: [slow] * N for k in ("forward", "recompute", "backward")},
                        host_fetch_share=[0.5] * N, forward_s=[slow] * N, backward_s=[slow] * N))
    predicted = rt.plan.predicted_step_s
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    torch._dynamo.reset()
    for _ in range(REFINE_STEPS + 1):  # no optimizer attached: the first step ends when the second begins
        _step(compiled, model, x)
    host = rt.plan_driver.cost_model.host_s
    assert all(0 < s < slow for s in host["forward"]) and all(0 < s < slow for s in host["backward"])
    # a recompute is measured only where the plan recomputes; elsewhere the known value stays
    assert all((s < slow) == (b in rt.plan.recomputed) for b, s in enumerate(host["recompute"]))
    assert rt.plan.predicted_step_s == predicted and rt.stats()["host_refinements"] >= 2 * N
    gpu = rt.plan_driver.cost_model
    assert all(0 < s < slow for s in gpu.forward_s + gpu.backward_s) and rt.stats()["compute_refinements"] >= 2 * N
    before = copy.deepcopy((host, gpu.forward_s, gpu.backward_s))
    _step(compiled, model, x)
    assert (rt.plan_driver.cost_model.host_s, gpu.forward_s, gpu.backward_s) == before
    assert rt.plan_driver.refining is None
    assert rt.replan().predicted_step_s < predicted  # the next plan is made from the lowered times


def test_refine_host_keeps_the_minimum_and_scales_a_resident_blocks_span_back():
    model = CostModel(host_s={"forward": [4.0, 4.0, 0.0], "recompute": [4.0] * 3, "backward": [4.0] * 3},
                      host_fetch_share=[0.5, 0.5, 0.5])
    lowered = model.refine_host({"forward": [3.0, 5.0, 2.0], "recompute": [0.0] * 3, "backward": [1.5, 0, 0]},
                                resident={2})
    # block 0 lowered; block 1 measured higher (kept); block 2 had nothing and was resident (2 s / (1 - 0.5));
    # recompute did not run; the resident-free block 0 backward lowered as measured.
    assert model.host_s == {"forward": [3.0, 4.0, 4.0], "recompute": [4.0] * 3, "backward": [1.5, 4.0, 4.0]}
    assert lowered == 3
    frozen = CostModel(host_s={"forward": [4.0]}, frozen=True)
    assert frozen.refine_host({"forward": [1.0]}, set()) == 0 and frozen.host_s == {"forward": [4.0]}
    assert CostModel().refine_host({"forward": [1.0]}, set()) == 0


def test_refine_compute_takes_a_recompute_for_the_forward_and_keeps_the_minimum():
    caller = [4.0, 4.0, 4.0]
    model = CostModel(forward_s=caller, backward_s=[8.0, 8.0, 8.0])
    lowered = model.refine_compute({"forward": [3.0, 1.0, 0.0], "recompute": [0.0, 2.0, 0.0],
                                    "backward": [9.0, 7.0, 0.0]})
    # block 1 recomputed: its forward counts the recompute (the training variant), 2.0, not the 1.0 forward;
    # block 0's backward measured higher (kept); block 2 did not run.
    assert model.forward_s == [3.0, 2.0, 4.0] and model.backward_s == [8.0, 7.0, 8.0] and lowered == 3
    assert caller == [4.0, 4.0, 4.0]  # the caller's list is not written
    assert CostModel().refine_compute({"forward": [1.0], "recompute": [0.0], "backward": [1.0]}) == 0


def test_the_gpu_time_outside_the_blocks_is_at_least_the_measured_turn_and_tail(monkeypatch):
    """other_s: the calibration step's residual, or the measured turn (last forward release to the first
    backward start) plus tail (last release to the step's end) where that is more, on the GPU's clock."""
    from torch_stagehand.runtime.conductor import calibrate

    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: next(clock))
    cal = calibrate.Calibration(2, torch.device("cpu"))
    for block, kind in ((0, "forward"), (1, "forward"), (1, "backward"), (0, "backward")):
        cal.on_wait(block, kind)
        cal.on_release(block)
    # Each wait / release reads the clock twice (timer event, host mark): block 1's forward release event
    # at tick 7, block 1's backward start at 9, the last release at 15, the finish's end event at 17.
    assert cal.gpu.glue_seconds(17.0) == (9 - 7) + (17 - 15)
    model = cal.finish(CostModel(frozen=True), lambda m: (100.0, 0))  # a residual of zero
    assert model.other_s == 4.0 and model.measured["calibration_glue_s"] == 4.0


@pytest.mark.parametrize("budget", ["half", "tiny"])
def test_the_plans_h2d_bytes_are_what_a_step_moves(budget):
    """`stats()["planned_h2d_bytes"]`, the bytes the plan must copy up a step (the limit the benches divide by
    the link's bandwidth), is what a step under that plan copies: each streamed block's fetches, the slots'
    reuse across the forward-backward turn counted, nothing for the resident blocks."""
    model, x = _model()
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget(budget))
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    torch._dynamo.reset()
    _step(compiled, model, x)  # the first step compiles
    before = rt.stats()["h2d_bytes"]
    _step(compiled, model, x)
    stats = rt.stats()
    streamed = (N - stats["resident_blocks"]) * _block_bytes()
    assert stats["h2d_bytes"] - before == stats["planned_h2d_bytes"] <= 2 * streamed
    assert stats["planned_h2d_bytes"] > 0


def test_a_trained_blocks_weights_are_fetched_again_in_the_next_forward():
    """Full fine-tuning: the optimizer writes a trained block's master, so the slot the backward left it in is
    stale and the next forward fetches it: the plan's bytes a step count that fetch."""
    from torch_stagehand.optim import HostAdamW

    model, x = _model()
    model.requires_grad_(True)
    rt = stagehand.offload(model, device="cpu", vram_budget=_budget("tiny"))
    opt = HostAdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    torch._dynamo.reset()
    for _ in range(2):
        before = rt.stats()["h2d_bytes"]
        _step(compiled, model, x)
        opt.step()
    stats = rt.stats()
    assert stats["h2d_bytes"] - before == stats["planned_h2d_bytes"]
