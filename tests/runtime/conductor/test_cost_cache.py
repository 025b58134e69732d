"""The calibrated cost model kept on disk (runtime/conductor/cost_cache.py): a later run of the same job
starts from it and skips calibration; another job, or an entry that is not usable, does not.

On the CPU no step is calibrated (there is no device clock), so the runs here stand in for the
calibration with a measured model written through the runtime's own `kept.keep`, then check what a
second runtime (an identical model, offloaded again, compiled again) does with it."""

from __future__ import annotations

import json
import os

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.runtime.conductor import cost_cache
from torch_stagehand.runtime.conductor.costs import MEASURED, CostModel

from _helpers import block_bytes_by_precision, toy

N = 4


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEHAND_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STAGEHAND_COST_CACHE", "1")
    return tmp_path


def _measured(n=N, step_s=0.25) -> CostModel:
    # No device bytes besides the weights: on the CPU the budget bounds the streamed weights alone.
    return CostModel(h2d_bps=12e9, d2h_bps=11e9, forward_s=[0.01 * (b + 1) for b in range(n)],
                     backward_s=[0.02] * n, activation_bytes=[0] * n, input_bytes=[0] * n,
                     host_s={k: [0.001] * n for k in cost_cache.HOST_KINDS}, host_fetch_share=[0.3] * n,
                     base_bytes=0, other_s=0.05, measured={"h2d": "cached", "calibration_step_s": step_s})


def _run(batch=2, budget_blocks=N - 1, calibrated=None):
    """Offload and compile a fresh toy model (same init every call), run one step; the runtime."""
    torch.manual_seed(0)
    model, x = toy(n=N)
    x = x[:1].expand(batch, *x.shape[1:]).contiguous().requires_grad_(True)
    budget = budget_blocks * block_bytes_by_precision(toy(n=N)[0])["bf16"][0]
    rt = stagehand.offload(model, device="cpu", vram_budget=budget)
    if calibrated is not None:
        rt.plan_driver.calibrated = calibrated  # as a GPU run before its calibration step
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    compiled(x).float().square().mean().backward()
    return rt


def test_a_kept_model_is_loaded_by_the_next_run_of_the_same_job_and_skips_calibration(cache_dir):
    first = _run()
    assert first.plan_driver.kept.inputs is not None  # the first graph named the job
    first.plan_driver.kept.keep(_measured())
    files = os.listdir(cache_dir / "cost_models")
    assert len(files) == 1
    first.restore()

    second = _run(calibrated=False)
    model = second.plan_driver.cost_model
    assert second.plan_driver.calibrated and second.plan_driver._calibrate_at is None
    assert model.source == MEASURED and model.forward_s == _measured().forward_s
    assert model.host_s == _measured().host_s and model.other_s == 0.05
    assert model.measured["cost_cache"] == str(cache_dir / "cost_models" / files[0])
    assert second.plan.kind == "planned" and second.stats()["cost_model_cache"].startswith("calibrated cost model loaded")
    second.restore()


@pytest.mark.parametrize("change", ["batch", "precision"])
def test_another_shape_or_precision_map_misses(cache_dir, change):
    first = _run()
    first.plan_driver.kept.keep(_measured())
    first.restore()
    if change == "batch":
        second = _run(batch=3, calibrated=False)
    else:
        torch.manual_seed(0)
        model, x = toy(n=N)
        second = stagehand.offload(model, device="cpu", vram_budget=N * 2**20,
                                   precision={b: "int8" for b in range(N)})
        second.plan_driver.calibrated = False
        torch._dynamo.reset()
        torch.compile(model, backend="stagehand", options={"inner": "eager"})(x.requires_grad_(True)).sum().backward()
    assert not second.plan_driver.calibrated
    assert "no calibrated cost model kept" in second.stats()["cost_model_cache"]
    assert "cost_cache" not in second.plan_driver.cost_model.measured
    second.restore()


def test_no_model_is_kept_before_one_was_measured_nor_with_the_cache_off(cache_dir, monkeypatch):
    rt = _run()
    rt.plan_driver.kept.keep(CostModel())  # defaults: nothing measured
    rt.plan_driver.kept.keep(CostModel(forward_s=[1.0] * N, backward_s=[1.0] * N))  # given by hand
    assert not (cache_dir / "cost_models").exists()
    rt.restore()
    monkeypatch.setenv("STAGEHAND_COST_CACHE", "0")
    rt = _run()
    assert rt.plan_driver.kept.inputs is None
    rt.plan_driver.kept.keep(_measured())
    assert not (cache_dir / "cost_models").exists()
    rt.restore()


KEY = {"format": cost_cache.FORMAT, "device": "cpu", "torch": torch.__version__, "layout": "4blocks-x",
       "precision": ["bf16"] * N, "grad_bytes": [0] * N, "inputs": "abc"}


def test_entry_round_trip(cache_dir):
    path = cost_cache.save_entry(_measured(), KEY)
    model, _, note = cost_cache.read_entry(KEY, N)
    assert note == f"calibrated cost model loaded from {path}"
    kept = _measured()
    for name in cost_cache.PER_BLOCK + cost_cache.SCALARS + ("host_s",):
        assert getattr(model, name) == getattr(kept, name), name
    assert model.grad_bytes is None and model.optimizer_s is None and not model.frozen


def _write(path, entry):
    with open(path, "w") as f:
        f.write(entry if isinstance(entry, str) else json.dumps(entry))


@pytest.mark.parametrize("damage, why", [
    (lambda e: "{not json", "Expecting property name"),
    (lambda e: dict(e, key=dict(KEY, inputs="other")), "it holds another key"),
    (lambda e: {"key": KEY, "model": dict(e["model"], forward_s=[0.1] * (N - 1))},
     f"forward_s is not {N} finite non-negative numbers"),
    (lambda e: {"key": KEY, "model": dict(e["model"], backward_s=[float("nan")] * N)},
     f"backward_s is not {N} finite non-negative numbers"),
    (lambda e: {"key": KEY, "model": dict(e["model"], host_s={"forward": [0.0] * N})}, "host_s does not have"),
    (lambda e: {"key": KEY, "model": dict(e["model"], other_s=-1.0)}, "other_s is not a finite"),
    (lambda e: {"key": KEY, "model": dict(e["model"], measured={})}, "not measured by a calibration step"),
    (lambda e: {"key": KEY, "model": {k: v for k, v in e["model"].items() if k != "input_bytes"}}, "input_bytes"),
])
def test_an_unusable_entry_is_ignored_with_its_reason(cache_dir, damage, why):
    path = cost_cache.save_entry(_measured(), KEY)
    with open(path) as f:
        entry = json.load(f)
    _write(path, damage(entry))
    model, _, note = cost_cache.read_entry(KEY, N)
    assert model is None
    assert note.startswith(f"cost model cache {path} ignored: ") and why in note


def test_an_unwritable_cache_costs_nothing_but_the_next_calibration(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cost_cache.save_entry(_measured(), KEY, root=str(blocker)) is None
    assert cost_cache.read_entry(KEY, N, root=str(blocker))[0] is None


def _decisions(rt, resident=(), recompute=(0, 1, 2, 3), slots=2) -> dict:
    return {"resident": list(resident), "recompute": list(recompute), "spill": [], "slots": slots,
            "budget": [rt.plan_driver.budget.soft, rt.plan_driver.budget.hard]}


def test_the_next_run_resumes_the_plan_the_first_one_ended_on(cache_dir):
    """Not the plan its search would make from the kept model (which may keep or recompute other blocks than the
    variants the first run compiled): the one kept beside it, predicted under that model."""
    first = _run()
    made = first.plan_driver.plan
    decisions = _decisions(first, recompute=[b for b in range(N) if b not in made.recomputed] or [0])
    first.plan_driver.kept.keep(_measured(), decisions)
    first.restore()
    second = _run(calibrated=False)
    plan = second.plan_driver.plan
    assert plan.kind == "planned" and plan.recomputed == set(decisions["recompute"]) and plan.resident == set()
    assert plan.slots == 2 and any("resumed" in n for n in plan.notes)
    assert plan.predicted_step_s > 0 and plan.cost_model == MEASURED  # predicted under the kept model
    second.restore()


@pytest.mark.parametrize("why", ["another budget", "malformed"])
def test_a_kept_plan_for_another_budget_or_not_usable_is_not_resumed(cache_dir, why):
    first = _run()
    decisions = _decisions(first)
    if why == "malformed":
        decisions["recompute"] = [N + 5]  # no such block
    first.plan_driver.kept.keep(_measured(), decisions)
    first.restore()
    second = _run(budget_blocks=N - 2 if why == "another budget" else N - 1, calibrated=False)
    note = second.stats()["cost_model_cache"]
    assert second.plan_driver.calibrated and note.startswith("calibrated cost model loaded")  # the model is used
    assert not any("resumed" in n for n in second.plan_driver.plan.notes)
    assert ("its plan ignored: recompute is not a list of block numbers below 4" in note) == (why == "malformed")
    second.restore()
