"""A predicted time says when it rests on the default cost model (nothing measured: the CPU, or CUDA
before calibration): the plan's summary and table, explain's plan table, and `stats()["cost_model"]`."""

from __future__ import annotations

import torch

import torch_stagehand as stagehand
from torch_stagehand.runtime.conductor.costs import DEFAULT, GIVEN, MEASURED, CostModel

from _helpers import block_bytes_by_precision, toy

NOTE = "(default cost model)"
N = 4


def _offloaded(blocks_resident: int = 2):
    model, x = toy(n=N)
    for block in model.blocks:
        block.norm.requires_grad_(True)  # something to train, so the steps have a backward
    b = block_bytes_by_precision(model)["bf16"][0]
    rt = stagehand.offload(model, device="cpu", vram_budget=(blocks_resident + 2) * b, verbose=False)
    return model, x.requires_grad_(True), rt


def test_the_source_follows_what_set_the_block_times():
    assert CostModel().source == DEFAULT
    assert CostModel(h2d_bps=50e9, measured={"h2d": "measured"}).source == DEFAULT  # compute is still the guess
    assert CostModel(forward_s=[1e-3], backward_s=[2e-3], frozen=True).source == GIVEN
    assert CostModel(measured={"calibration_step_s": 0.1}, forward_s=[1e-3], backward_s=[2e-3]).source == MEASURED


def test_a_plan_from_the_default_cost_model_says_so_wherever_it_shows_a_predicted_time():
    model, x, rt = _offloaded()
    plan = rt.plan
    assert plan.kind == "planned" and plan.cost_model == DEFAULT
    summary, header = plan.summary(), plan.table().splitlines()[0]
    assert f"ms {NOTE}" in summary and f"predicted ms {NOTE}" in header
    assert str(plan).count(NOTE) == 2  # the summary and the table's time column
    assert rt.stats()["cost_model"] == DEFAULT and rt.stats()["predicted_step_ms"] > 0
    report = stagehand.explain(model, x)
    assert f"predicted ms {NOTE}" in report.plan_table() and NOTE in str(report)
    rt.restore()


def test_a_given_cost_model_is_not_called_default():
    model, x, rt = _offloaded()
    rt.replan(CostModel(forward_s=[1e-3] * N, backward_s=[2e-3] * N, frozen=True))
    assert rt.plan.cost_model == GIVEN and NOTE not in str(rt.plan) and rt.stats()["cost_model"] == GIVEN
    rt.restore()


def test_a_calibrated_plan_drops_the_note():
    """The CPU runs the calibrate-then-plan path when asked: the calibrating plan is still the default's
    guess; the plan made from the measured step is not."""
    model, x, rt = _offloaded()
    rt.plan_driver.calibrated = False  # the CPU keeps the defaults unless asked; CUDA always calibrates
    rt.replan()
    assert rt.plan.kind == "calibrating" and NOTE in rt.plan.summary()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    rt.attach(optimizer)
    for _ in range(3):  # warm-up, measured, then the plan made from the measurements
        compiled(x).float().square().mean().backward()
        optimizer.step()
    assert rt.plan.kind == "planned" and rt.plan_driver.cost_model.source == MEASURED
    assert rt.plan.cost_model == MEASURED and NOTE not in str(rt.plan)
    assert rt.stats()["cost_model"] == MEASURED
    rt.restore()
