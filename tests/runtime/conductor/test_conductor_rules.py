"""The run-time Conductor: budget modes and priorities, transfer tokens, the three rules, monotonic hints,
zero-cost disable, and what the runtime does with them (denials degrade to later fetches; numbers unchanged)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.config import Config, ConductorConfig
from torch_stagehand.runtime.conductor.conductor import (WINDOW_CAP, BudgetDenial, BudgetManager, BudgetMode, Conductor,
                                                        Direction, PrefetchRules, Priority, TransferDenial,
                                                        TransferManager)
from torch_stagehand.runtime.conductor.costs import CostModel
from torch_stagehand.runtime.conductor.planner import build_plan

from _helpers import assert_exact, block_bytes_by_precision, toy

# ---- budget manager ----------------------------------------------------------------------------


def test_budget_modes_grant_and_deny_with_reasons():
    used = {"external": 0}
    bm = BudgetManager(soft_cap=100, hard_cap=150, external=lambda: used["external"])
    assert bm.request("a", 60, BudgetMode.HARD).granted == 60
    hard = bm.request("a", 60, BudgetMode.HARD)  # 120 > soft 100: all or nothing
    assert not hard and hard.denial is BudgetDenial.SOFT_CAP_EXCEEDED
    soft = bm.request("b", 60, BudgetMode.SOFT)  # what is left under the soft cap
    assert soft.granted == 40 and soft.partial
    burst = bm.request("c", 40, BudgetMode.BURST)  # over soft, under hard
    assert burst.granted == 40 and bm.reserved == 140
    over = bm.request("c", 20, BudgetMode.BURST)
    assert over.denial is BudgetDenial.HARD_CAP_EXCEEDED
    nothing = bm.request("d", 5, BudgetMode.SOFT)
    assert nothing.denial is BudgetDenial.NOTHING_LEFT
    bm.release(soft)
    bm.release(burst)
    floor = bm.request("e", 80, BudgetMode.FLOOR)  # a guaranteed minimum: under the hard cap, all or nothing
    assert floor.granted == 80 and bm.reserved == 140
    assert bm.request("e", 20, BudgetMode.FLOOR).denial is BudgetDenial.HARD_CAP_EXCEEDED
    # External use counts: the device is fuller than the reservations say.
    bm.release(floor)
    used["external"] = 50
    assert bm.request("f", 60, BudgetMode.HARD).denial is BudgetDenial.SOFT_CAP_EXCEEDED
    assert bm.pressure() == pytest.approx((60 + 50) / 150)
    assert (bm.grants, bm.partials) == (4, 1) and bm.denials == 5


def test_budget_priorities_and_ceiling_and_phase_scope():
    bm = BudgetManager(soft_cap=100, hard_cap=150, headroom=30)
    assert bm.request("w", 60, BudgetMode.HARD, Priority.REQUIRED)
    # Speculative work must leave the headroom free for the required work that follows.
    spec = bm.request("w", 20, BudgetMode.HARD, Priority.SPECULATIVE)
    assert spec.denial is BudgetDenial.HEADROOM_RESERVED
    assert bm.request("w", 20, BudgetMode.HARD, Priority.REQUIRED)
    # The block that must compute now may go up to the hard cap, whatever the mode.
    assert bm.request("w", 70, BudgetMode.HARD, Priority.CRITICAL).granted == 70
    assert bm.request("w", 1, BudgetMode.HARD, Priority.CRITICAL).denial is BudgetDenial.HARD_CAP_EXCEEDED
    bm2 = BudgetManager(soft_cap=100, hard_cap=150)
    assert bm2.request("spill", 30, BudgetMode.CEILING).granted == 0  # a bound, no bytes
    assert bm2.request("spill", 20, BudgetMode.HARD, Priority.BACKGROUND, phase="forward")
    assert bm2.request("spill", 20, BudgetMode.HARD, Priority.BACKGROUND).denial is BudgetDenial.CEILING_EXCEEDED
    assert bm2.request("other", 20, BudgetMode.HARD)
    assert bm2.end_phase("forward") == 1 and bm2.reserved == 20


# ---- transfer manager --------------------------------------------------------------------------


def test_transfer_pools_are_separate_and_denials_are_typed():
    tm = TransferManager(h2d_slots=2, d2h_slots=1)
    a = tm.request(Direction.H2D, Priority.REQUIRED, key=1)
    b = tm.request(Direction.H2D, Priority.SPECULATIVE, key=2)
    assert tm.request(Direction.H2D, Priority.REQUIRED, key=3) is TransferDenial.H2D_SLOTS_EXHAUSTED
    d = tm.request(Direction.D2H, Priority.BACKGROUND, key=1)  # the other direction has its own pool
    assert tm.request(Direction.D2H, Priority.BACKGROUND) is TransferDenial.D2H_SLOTS_EXHAUSTED
    assert tm.request(Direction.H2D, Priority.CRITICAL, key=4).priority is Priority.CRITICAL  # never denied
    tm.complete_key(Direction.H2D, 1)  # a's copy
    tm.complete_key(Direction.H2D, 4)
    tm.suppress_speculative = True
    assert tm.request(Direction.H2D, Priority.SPECULATIVE) is TransferDenial.PHASE_RULE_SUPPRESSED_SPECULATIVE
    tm.suppress_speculative = False
    tm.limits[Direction.H2D] = 1  # a hint caps the in-flight copies below the pool's size
    assert tm.request(Direction.H2D, Priority.REQUIRED) is TransferDenial.H2D_LIMITED_BY_HINT
    assert tm.denials == {"h2d_slots_exhausted": 1, "d2h_slots_exhausted": 1,
                          "phase_rule_suppressed_speculative": 1, "h2d_limited_by_hint": 1}
    assert isinstance(b, object) and isinstance(d, object)


# ---- the three rules and monotonic hints --------------------------------------------------------


def test_rule_1_backward_pressure_suppresses_speculative_and_cuts_the_window():
    policy = PrefetchRules(h2d_slots=3, d2h_slots=2, window=3)
    assert policy.update("forward", 0.95, 0).prefetch_window_cap == 3  # pressure outside backward: no rule
    assert policy.update("backward", 0.79, 0).prefetch_window_cap == 3  # under the threshold: no rule
    h = policy.update("backward", 0.81, 0)
    assert h.prefetch_window_cap == 1 and h.suppress_speculative and "backward_pressure" in h.reasons


def test_rule_2_optimizer_phase_limits_h2d_to_one_and_suppresses_speculative():
    policy = PrefetchRules(h2d_slots=3, d2h_slots=2, window=3)
    h = policy.update("optimizer", 0.0, 0)
    assert h.max_inflight_h2d == 1 and h.suppress_speculative and h.prefetch_window_cap == 3
    assert h.reasons == ("optimizer_phase",)


def test_rule_3_contention_shrinks_the_window_progressively():
    policy = PrefetchRules(h2d_slots=4, d2h_slots=2, window=4, contention_checks=3)
    assert policy.update("forward", 0.0, 3).prefetch_window_cap == 4  # three full checks: not yet
    assert policy.update("forward", 0.0, 4).prefetch_window_cap == 3
    assert policy.update("forward", 0.0, 5).prefetch_window_cap == 2
    assert policy.update("forward", 0.0, 6).prefetch_window_cap == 1
    assert policy.update("forward", 0.0, 7).prefetch_window_cap == 1  # never below one


def test_hints_are_monotonic_within_a_step_and_reset_at_step_begin():
    policy = PrefetchRules(h2d_slots=3, d2h_slots=2, window=3)
    seen = [policy.update("backward", 0.9, 0)]
    for phase, pressure in [("backward", 0.1), ("forward", 0.0), ("optimizer", 0.0), ("backward", 0.0)]:
        seen.append(policy.update(phase, pressure, 0))
    for before, after in zip(seen, seen[1:]):
        assert after.prefetch_window_cap <= before.prefetch_window_cap
        assert after.max_inflight_h2d <= before.max_inflight_h2d
        assert after.suppress_speculative or not before.suppress_speculative
    assert seen[-1].suppress_speculative and seen[-1].prefetch_window_cap == 1 and seen[-1].max_inflight_h2d == 1
    fresh = policy.reset()
    assert (fresh.prefetch_window_cap, fresh.max_inflight_h2d, fresh.suppress_speculative) == (3, 3, False)


def test_conductor_phase_changes_drive_the_hints_and_admissions():
    pressure = {"now": 0.0}
    c = Conductor(ConductorConfig(h2d_slots=4, prefetch_window=3), soft_cap=1000, hard_cap=1000,
                  pressure=lambda: pressure["now"])
    c.reserve_plan([], slot_bytes=100, slots=4, window=3)
    c.on_phase("step_begin")
    c.on_phase("forward")
    assert c.admit_prefetch(1, depth=0) is None and c.admit_prefetch(2, depth=2) is None
    c.copy_consumed(1)
    c.copy_consumed(2)
    pressure["now"] = 0.9
    c.on_phase("backward")
    assert c.admit_prefetch(3, depth=1) == WINDOW_CAP  # rule 1 cut the window to one block ahead
    assert c.admit_prefetch(3, depth=0) is None  # the next block is still fetched ahead
    c.on_phase("optimizer")
    pressure["now"] = 0.0
    c.on_phase("step_begin")  # a new step: the plan's window again
    assert c.hints.prefetch_window_cap == 3 and not c.hints.suppress_speculative
    assert c.snapshot()["conductor_denials"] == {WINDOW_CAP: 1}


def test_budget_denied_slots_shorten_the_window_and_say_so():
    c = Conductor(ConductorConfig(), soft_cap=250, hard_cap=250)
    # Four slots of 100 bytes asked for: only two fit under the soft cap.
    assert c.reserve_plan([], slot_bytes=100, slots=4, window=3) == 1
    assert c.window_notes and "not granted: soft_cap_exceeded" in c.window_notes[0]


# ---- in the runtime ------------------------------------------------------------------------------

N = 6


def _manual_plan(rt, slots: int):
    """Every block streamed through `slots` slots (lookahead slots - 1), activations kept."""
    costs = CostModel().block_costs([rt.store.nbytes(b, "bf16") for b in range(N)])
    return build_plan(costs, ["bf16"] * N, set(), set(), slots, CostModel(), kind="manual")


def _train(model, x, steps=2, call=None):
    out = None
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        out = (call if call is not None else model)(x)
        out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(out, grads, ref_out, ref_grads):
    # However the conductor fetches, the same ops run on the same weights: measured 0 (CPU, torch 2.13, 3 seeds).
    assert_exact(out, ref_out)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        assert_exact(grads[k], ref_grads[k], msg=k)


def _trainable_toy():
    model, x = toy(n=N)
    for block in model.blocks:
        block.norm.requires_grad_(True)
    return model, x


def test_rule_1_in_the_runtime_denied_speculative_prefetches_degrade_to_later_fetches():
    model, x = _trainable_toy()
    ref_out, ref_grads = _train(copy.deepcopy(model), x)
    b = block_bytes_by_precision(model)["bf16"][0]
    rt = stagehand.offload(model, device="cpu", vram_budget=100 * b)
    rt.plan_driver.apply("test", _manual_plan(rt, slots=4))
    assert rt.plan.lookahead == 3
    rt.plan_driver.conductor._pressure = lambda: 0.95  # the device is 95% full
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    torch._dynamo.reset()
    out, grads = _train(model, x, call=compiled)
    _assert_same(out, grads, ref_out, ref_grads)
    denials = rt.plan_driver.conductor.denials
    assert denials.get(WINDOW_CAP, 0) > 0  # backward prefetched one block ahead only
    assert rt.stats()["stale_slots"] == 0


def test_an_allocation_failure_during_a_prefetch_shrinks_the_window_and_the_step_completes(monkeypatch):
    model, x = _trainable_toy()
    ref_out, ref_grads = _train(copy.deepcopy(model), x, steps=1)
    b = block_bytes_by_precision(model)["bf16"][0]
    rt = stagehand.offload(model, device="cpu", vram_budget=100 * b)
    rt.plan_driver.apply("test", _manual_plan(rt, slots=4))
    real = rt.pool.prefetch
    failures = []

    def flaky(block, precision):
        if not failures:
            failures.append(block)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(block, precision)

    monkeypatch.setattr(rt.pool, "prefetch", flaky)
    out, grads = _train(model, x, steps=1)
    assert failures
    _assert_same(out, grads, ref_out, ref_grads)
    conductor = rt.plan_driver.conductor
    assert conductor.denials.get("allocation_failed") == 1
    assert any("could not allocate" in note and "window cut to 2" in note for note in conductor.window_notes)


def test_disabled_conductor_allocates_nothing_and_changes_nothing():
    model, x = _trainable_toy()
    ref_out, ref_grads = _train(copy.deepcopy(model), x, steps=1)
    b = block_bytes_by_precision(model)["bf16"][0]
    rt = stagehand.offload(model, device="cpu", vram_budget=3 * b,
                           config=Config(conductor=ConductorConfig(enabled=False)))
    conductor = rt.plan_driver.conductor
    assert not conductor.enabled and vars(conductor) == {"enabled": False}  # no sub-object at all
    out, grads = _train(model, x, steps=1)
    _assert_same(out, grads, ref_out, ref_grads)
    with torch.no_grad():
        model(x)  # a new step: the last one is recorded
    record = rt.telemetry.records[-1]
    assert "hints" not in record and "budget" not in record and record["plan"]["streamed_blocks"] >= 1


def test_telemetry_lines_carry_hints_denials_and_phases(tmp_path):
    model, x = _trainable_toy()
    b = block_bytes_by_precision(model)["bf16"][0]
    path = tmp_path / "telemetry.jsonl"
    rt = stagehand.offload(model, device="cpu", vram_budget=100 * b, config=Config(telemetry_file=str(path)))
    rt.plan_driver.apply("test", _manual_plan(rt, slots=3))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    rt.attach(optimizer)
    for _ in range(2):
        model(x).float().square().mean().backward()
        optimizer.step()
    rt.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2
    last = lines[-1]
    assert {"forward", "backward", "optimizer"} <= set(last["phase_durations"])
    assert last["hints"]["prefetch_window_cap"] >= 1 and "conductor_denials" in last
    assert last["plan"]["streamed_blocks"] == N and "budget" in last
