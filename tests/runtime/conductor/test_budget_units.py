"""A VRAM budget says its unit: a bare "20" is refused (not read as 20 bytes), and a number of bytes too
small to be meant (20, 512: GiB or MB meant) is refused, both naming the units to use."""

from __future__ import annotations

import pytest

import torch_stagehand as stagehand
from torch_stagehand.runtime.conductor.costs import MIN_BUDGET_BYTES, BudgetError, parse_bytes
from torch_stagehand.runtime.streamed import is_streamed

from _helpers import toy

UNITS = r"'20GiB'.*GiB = 2\*\*30 bytes.*'20GB'.*GB = 10\*\*9 bytes"


@pytest.mark.parametrize("text", ["20", " 20 ", "0.5", "16000"])
def test_a_string_without_a_unit_is_refused_with_the_units(text):
    with pytest.raises(BudgetError, match=rf"vram_budget: '{text}' has no unit; write .*{UNITS}"):
        parse_bytes(text)


def test_a_string_with_a_unit_is_read_as_written():
    assert parse_bytes("20GiB") == 20 * 2**30 and parse_bytes("20 GB") == 20 * 10**9
    assert parse_bytes("300KB") == 300_000 and parse_bytes("20B") == 20  # a unit written is honoured


@pytest.mark.parametrize("number", [20, 512, 16.5, MIN_BUDGET_BYTES - 1])
def test_a_number_of_bytes_too_small_to_be_meant_is_refused(number):
    with pytest.raises(BudgetError, match=rf"vram_budget: {number!r} is {number!r} bytes .*write .*{UNITS}"):
        parse_bytes(number)
    assert parse_bytes(MIN_BUDGET_BYTES) == MIN_BUDGET_BYTES and parse_bytes(24 * 2**30) == 24 * 2**30


def test_offload_and_replan_refuse_a_budget_without_a_unit_and_change_nothing():
    model, _ = toy(n=4)
    with pytest.raises(BudgetError, match="offload: vram_budget: '20' has no unit"):
        stagehand.offload(model, device="cpu", vram_budget="20", verbose=False)
    assert not any(is_streamed(m) for m in model.modules())  # refused before the model was touched
    rt = stagehand.offload(model, device="cpu", vram_budget="1MiB", verbose=False)
    plan = rt.plan
    with pytest.raises(BudgetError, match="vram_budget: 20 is 20 bytes"):
        rt.replan(vram_budget=20)
    assert rt.plan is plan and rt.plan_driver.budget.soft == 2**20
    rt.restore()
