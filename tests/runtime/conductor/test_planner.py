"""The VRAM-budget planner (pure) on synthetic cost models: its choices and its predictions."""

from __future__ import annotations

import pytest

from torch_stagehand.runtime.conductor.costs import BlockCost, Budget, BudgetError, CostModel, parse_bytes
from torch_stagehand.runtime.conductor.planner import (KEEP, RECOMPUTE, activation_peak, build_plan, make_plan,
                                                       predicted_peak, simulate, spread)

MiB, GiB = 2**20, 2**30


def _uniform(n=8, weights=100 * MiB, fwd=2e-3, bwd=4e-3, act=300 * MiB, inp=10 * MiB):
    return [BlockCost(weights, fwd, bwd, act, inp) for _ in range(n)]


def _model(**kw):
    return CostModel(h2d_bps=kw.pop("h2d_bps", 50e9), base_bytes=kw.pop("base", 1 * GiB), frozen=True, **kw)


def _plan(costs, soft=None, hard=None, model=None):
    return make_plan(costs, ["bf16"] * len(costs), Budget(soft, hard), model or _model())


def test_a_budget_that_fits_everything_keeps_every_block_resident_and_every_activation():
    costs = _uniform()
    plan = _plan(costs, soft=100 * GiB)
    assert plan.resident == set(range(8)) and plan.recomputed == set()
    assert plan.slots == 0 and plan.lookahead == 0
    assert all(p.h2d_bytes == 0 for p in plan.blocks)
    assert plan.counts()["resident_blocks"] == 8
    # Predicted time is the compute alone: nothing waits on PCIe.
    assert plan.predicted_step_s == pytest.approx(sum(c.forward_s + c.backward_s for c in costs))


def test_a_tiny_budget_streams_every_block_and_recomputes():
    costs = _uniform()
    smallest = predicted_peak(costs, set(), set(range(7)), 1, 100 * MiB, 1 * GiB)
    plan = _plan(costs, soft=smallest + MiB)
    assert plan.resident == set()
    assert plan.recomputed >= set(range(7))  # the last block's recompute would add, not save (see activation_peak)
    assert all(p.activations == RECOMPUTE for p in plan.blocks if p.block in plan.recomputed)
    assert plan.predicted_peak_bytes <= smallest + MiB


def test_the_predicted_peak_never_crosses_the_cap_and_more_budget_is_never_predicted_slower():
    costs = _uniform(n=12)
    times = []
    for gib in (3, 4, 5, 6, 8, 10, 12, 16, 20):
        plan = _plan(costs, soft=gib * GiB)
        assert plan.predicted_peak_bytes <= gib * GiB
        times.append(plan.predicted_step_s)
    assert times == sorted(times, reverse=True)
    assert times[0] > times[-1]  # the sweep spans plans that differ


def test_soft_cap_is_planned_for_hard_cap_is_the_fallback():
    costs = _uniform()
    floor = _plan(costs, soft=100 * GiB).predicted_peak_bytes  # what everything resident and kept needs
    both = _plan(costs, soft=floor + GiB, hard=floor + 2 * GiB)
    assert not both.over_soft_cap and both.resident == set(range(8))
    tight = predicted_peak(costs, set(), set(range(7)), 1, 100 * MiB, 1 * GiB)
    over = _plan(costs, soft=tight - 10 * MiB, hard=tight + 10 * MiB)
    assert over.over_soft_cap and over.predicted_peak_bytes <= tight + 10 * MiB
    with pytest.raises(BudgetError, match="no plan fits the VRAM budget.*needs"):
        _plan(costs, soft=tight - 10 * MiB, hard=tight - 5 * MiB)


def test_resident_blocks_are_spread_so_copies_overlap_their_compute():
    assert spread(0, 8) == set() and spread(8, 8) == set(range(8))
    assert spread(2, 8) == {2, 6}
    # Transfer-bound streaming: each resident block hides part of the copies, so a plan with half the
    # blocks resident is predicted faster than all streamed, and slower than all resident.
    costs = _uniform(fwd=1e-3, bwd=1e-3, act=0, inp=0)
    model = _model(h2d_bps=10e9)
    t_all = simulate(costs, set(), set(), 2, model.h2d_bps)[0]
    t_half = simulate(costs, spread(4, 8), set(), 2, model.h2d_bps)[0]
    t_none = simulate(costs, set(range(8)), set(), 0, model.h2d_bps)[0]
    assert t_none < t_half < t_all
    # All streamed, transfer-bound: the step is about the copies (forward and backward, less the blocks
    # still in their slots at the turn).
    copies = (8 + 8 - 2) * costs[0].bytes / model.h2d_bps
    assert copies <= t_all <= copies + 2 * 2e-3


def test_recompute_only_where_it_saves_and_earliest_first():
    # Block 0 saves nothing by recomputing (its activations are no larger than its inputs).
    costs = [BlockCost(10 * MiB, 1e-3, 2e-3, 10 * MiB, 10 * MiB)] + _uniform(n=5, weights=10 * MiB)
    peak_all_kept = activation_peak(costs, set())
    plan = _plan(costs, soft=1 * GiB + 60 * MiB + peak_all_kept - 250 * MiB, model=_model())
    assert 0 not in plan.recomputed
    assert plan.recomputed and min(plan.recomputed) == 1  # the earliest that saves
    assert plan.blocks[0].activations == KEEP


def test_parse_bytes_reads_sizes_and_names_the_bad_ones():
    assert parse_bytes("20GiB") == 20 * GiB
    assert parse_bytes("512 MB") == 512_000_000
    assert parse_bytes("1.5g") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    for bad in ("lots", "-1GiB", 0, True, "20 GiBs", None):
        with pytest.raises(BudgetError, match="vram_budget"):
            parse_bytes(bad)


def test_plan_prints_as_a_table_with_predictions():
    plan = _plan(_uniform(n=4), soft=2 * GiB)
    text = str(plan)
    assert "predicted step" in text and "resident" in text and "predicted ms" in text
    assert len(plan.rows()) == 4


def test_spill_is_chosen_only_when_the_cost_model_says_it_pays():
    # 300 MiB of activations per block: 6 ms back over a 50 GB/s link; the forward costs 2 ms (recompute
    # is cheaper) or 20 ms (spill is cheaper). Without a measured D2H bandwidth spill is never chosen.
    budget = 1 * GiB + 8 * 100 * MiB + 1200 * MiB
    cheap_forward = _plan(_uniform(fwd=2e-3), soft=budget, model=_model(d2h_bps=50e9))
    assert cheap_forward.recomputed and not cheap_forward.spilled
    costly_forward = _plan(_uniform(fwd=20e-3), soft=budget, model=_model(d2h_bps=50e9))
    assert costly_forward.spilled and not costly_forward.recomputed
    assert costly_forward.counts()["spilled_blocks"] == len(costly_forward.spilled)
    assert all(p.activations == "spill" for p in costly_forward.blocks if p.block in costly_forward.spilled)
    unmeasured = _plan(_uniform(fwd=20e-3), soft=budget, model=_model())
    assert unmeasured.recomputed and not unmeasured.spilled
    # A spilled block holds nothing on the device until its backward.
    costs = _uniform()
    assert activation_peak(costs, set(), frozenset({0, 1})) == activation_peak(costs, set()) - 2 * 300 * MiB


def test_the_predicted_timeline_has_a_copy_per_streamed_fetch_and_a_compute_bar_per_block_and_pass():
    costs = _uniform(n=6, act=0, inp=0)
    plan = _plan(costs, soft=1 * GiB + 3 * 100 * MiB)
    lanes = plan.timeline()
    computes = [entry for entry in lanes if entry[0] == "compute"]
    copies = [entry for entry in lanes if entry[0] == "h2d"]
    assert len(computes) == 2 * 6  # forward and backward
    assert sorted({b for _, b, _, _ in copies}) == sorted(set(range(6)) - plan.resident)
    assert sum(p.h2d_bytes for p in plan.blocks) == len(copies) * 100 * MiB
    assert max(end for _, _, _, end in lanes) == pytest.approx(plan.predicted_step_s)
    for _, _, start, end in lanes:
        assert 0 <= start <= end


def test_a_host_slower_than_the_gpu_sets_the_predicted_pace():
    """The GPU cannot finish a block before the host has issued it: with host issue times above the GPU's,
    the step is the host's sum; below them, the prediction is the GPU's as before; recompute adds its
    host time to the backward's."""
    from dataclasses import replace

    gpu = _uniform(n=6, act=0, inp=0)
    resident = set(range(6))
    gpu_only, _, _ = simulate(gpu, resident, set(), 0, 50e9)
    quick_host = [replace(c, host_forward_s=1e-4, host_backward_s=1e-4) for c in gpu]
    assert simulate(quick_host, resident, set(), 0, 50e9)[0] == pytest.approx(gpu_only)
    slow_host = [replace(c, host_forward_s=5e-3, host_recompute_s=5e-3, host_backward_s=9e-3) for c in gpu]
    assert simulate(slow_host, resident, set(), 0, 50e9)[0] == pytest.approx(6 * (5e-3 + 9e-3))
    assert simulate(slow_host, resident, {0, 1}, 0, 50e9)[0] == pytest.approx(6 * (5e-3 + 9e-3) + 2 * 5e-3)
    # A resident block skips its fetch work: the share of host time the calibration saw in schedule ops.
    halved = [replace(c, host_fetch_share=0.5) for c in slow_host]
    assert simulate(halved, resident, set(), 0, 50e9)[0] == pytest.approx(6 * (5e-3 + 9e-3) / 2)
    assert simulate(halved, set(), set(), 6, 50e9)[0] >= 6 * (5e-3 + 9e-3)  # streamed: all of it
    # The timeline shows the host lane, and no compute bar ends before its host bar.
    plan = build_plan(slow_host, ["bf16"] * 6, resident, set(), 0, _model(), kind="planned")
    lanes = plan.timeline()
    host = {(b, i // 6): end for i, (lane, b, _, end) in enumerate(e for e in lanes if e[0] == "host")}
    compute = {(b, i // 6): end for i, (lane, b, _, end) in enumerate(e for e in lanes if e[0] == "compute")}
    assert len(host) == 12 and all(compute[k] >= host[k] - 1e-12 for k in host)


def test_calibration_measures_the_hosts_issue_time_per_block_and_kind(monkeypatch):
    """Host clock from one block's wait to the next (the glue between included); the last to its release."""
    import torch

    from torch_stagehand.runtime.conductor import calibrate

    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: next(clock))
    cal = calibrate.Calibration(2, torch.device("cpu"))
    for block, kind in ((0, "forward"), (1, "forward"), (1, "recompute"), (1, "backward"),
                        (0, "recompute"), (0, "backward")):
        cal.on_wait(block, kind)
        if block == 0:
            cal.on_schedule_op(1.0)  # host seconds inside a wait / prefetch / evict of block 0
        cal.on_release(block)
    model = cal.finish(CostModel(frozen=True), lambda m: (0.0, 0))
    # Each wait reads the clock twice (CPU event, host mark), each release twice (event, host mark):
    # a wait's mark is at 4k + 2, so every block's host span is 4 ticks; the last ends at its release (+2).
    assert model.host_s == {"forward": [4.0, 4.0], "recompute": [4.0, 4.0], "backward": [2.0, 4.0]}
    # A forward span above its recompute's (the host held back by a full launch queue) counts as the recompute.
    cal.host.marks[0] = (0, "forward", cal.host.marks[0][2] - 3.0)
    assert cal.host.seconds()["forward"] == [4.0, 4.0]
    costs = model.block_costs([1, 1])
    assert (costs[0].host_forward_s, costs[0].host_recompute_s, costs[0].host_backward_s) == (4.0, 4.0, 2.0)
    assert model.host_fetch_share == [pytest.approx(3 / 10), 0.0]


def test_fewest_savers_walks_the_peak_as_predicted_peak_does():
    """`_fewest_savers` keeps the peak in two per-block lists it edits per added block; it must choose what
    re-simulating `predicted_peak` after each block chose (the code before it), spills included."""
    import random

    from torch_stagehand.runtime.conductor.planner import _fewest_savers

    def reference(costs, resident, candidates, slots, slot_bytes, model, limit):
        recompute, spill = set(), set()
        if predicted_peak(costs, resident, recompute, slots, slot_bytes, model.base_bytes) <= limit:
            return recompute, frozenset()
        for b in candidates:
            spill_s = costs[b].activation_bytes / model.h2d_bps
            room = model.spill_room_bytes is None or (sum(costs[s].activation_bytes for s in spill)
                                                      + costs[b].activation_bytes <= model.spill_room_bytes)
            (spill if model.d2h_bps and spill_s < costs[b].forward_s and room else recompute).add(b)
            if predicted_peak(costs, resident, recompute, slots, slot_bytes, model.base_bytes,
                              frozenset(spill)) <= limit:
                return recompute, frozenset(spill)
        return None

    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 12)
        costs = [BlockCost(bytes=rng.randint(1, 50) * MiB, forward_s=rng.choice([0.001, 0.5]),
                           activation_bytes=rng.randint(0, 400) * MiB, input_bytes=rng.randint(0, 100) * MiB)
                 for _ in range(n)]
        model = CostModel(h2d_bps=1e9, d2h_bps=rng.choice([None, 1e9]),
                          spill_room_bytes=rng.choice([None, rng.randint(0, 800) * MiB]))
        model.base_bytes = rng.randint(0, 100) * MiB
        resident = {b for b in range(n) if rng.random() < 0.3}
        candidates = [b for b in range(n) if costs[b].activation_bytes > costs[b].input_bytes]
        rng.shuffle(candidates)
        args = (costs, resident, candidates, rng.randint(1, 3), 50 * MiB, model, rng.randint(100, 3000) * MiB)
        assert _fewest_savers(*args) == reference(*args), trial
