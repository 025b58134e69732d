"""The calibrated cost model, kept on disk for the next run of the same job (a warm start), with its last plan.

The key: the device, torch, the blocks' layout, the precision map, the gradient bytes, the ranks sharing the host
link and the compiled graph's inputs (not the budget). One JSON file per entry under `<cache_dir>/cost_models/`,
named by the key's hash and holding the key. An entry not usable is never used: the run calibrates and one line
says why. `STAGEHAND_COST_CACHE=0` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from typing import Callable

import torch

from torch_stagehand.runtime.atomic_file import write_atomic
from torch_stagehand.runtime.blocks import layout_fingerprint
from torch_stagehand.runtime.conductor.costs import MEASURED, CostModel, cache_dir
from torch_stagehand.runtime.conductor.planner import build_plan
from torch_stagehand.environment import env

log = logging.getLogger(__name__)

FORMAT = 1
# The fields kept: what calibration measured and later steps refined. Not `grad_bytes` / `optimizer_s`
# (facts of this run's trainable weights and optimizer, set when a plan is made) nor `frozen`.
PER_BLOCK = ("forward_s", "backward_s", "activation_bytes", "input_bytes", "host_fetch_share")
SCALARS = ("h2d_bps", "d2h_bps", "base_bytes", "other_s")
HOST_KINDS = ("forward", "recompute", "backward")


def job_key(device: torch.device, blocks: list[str], layers, precision: dict[int, str], grad_bytes, node) -> dict:
    """What a runtime's cost model is of, but its graph inputs (device, torch, layout, precision, gradients, ranks)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"format": FORMAT, "device": name, "torch": torch.__version__,
            "layout": layout_fingerprint(device.type, blocks, layers),
            "precision": [precision[b] for b in range(len(blocks))], "grad_bytes": list(grad_bytes),
            # The ranks of a node copying at once share its host link (host/node_store.py): a model of its own.
            "node_ranks": 1 if node is None else node.local_size}


def cost_key(job: dict, inputs: str) -> dict:
    """The cache key of a cost model measured for `job` (`job_key`) with graph inputs `inputs`."""
    return {**job, "inputs": inputs}


def entry_path(key: dict, root: str | None = None) -> str:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(root or cache_dir(), "cost_models", f"{name}.json")


def plan_decisions(plan, budget) -> dict:
    """What a plan decided (the blocks resident, recomputed, spilled and restored ahead, the rotating slots) and the
    budget it was made for: kept beside the model, so the next run of the job resumes the plan this one ended on."""
    return {"resident": sorted(plan.resident), "recompute": sorted(plan.recomputed), "spill": sorted(plan.spilled),
            "ahead": sorted(plan.restored_ahead), "slots": plan.slots, "budget": [budget.soft, budget.hard]}


def resumed_plan(decisions: dict | None, costs, precision, model: CostModel, budget):
    """The plan an earlier run of this job ended on (`plan_decisions`), predicted under the model it kept; None when
    there is none, it was made for another budget, or it no longer fits the device or, spilled, the host (a plan
    made afresh may differ, and each difference is a variant to compile in the first step)."""
    if decisions is None or decisions["budget"] != [budget.soft, budget.hard]:
        return None
    spill = frozenset(decisions["spill"])
    if model.spill_room_bytes is not None and sum(costs[b].activation_bytes for b in spill) > model.spill_room_bytes:
        return None
    plan = build_plan(costs, precision, set(decisions["resident"]), set(decisions["recompute"]), decisions["slots"],
                      model, "planned", budget=budget, spill=spill, ahead=frozenset(decisions.get("ahead", ())))
    if budget.limit is not None and plan.predicted_peak_bytes > budget.limit:
        return None
    plan.notes.append("resumed: the plan the earlier run of this job ended on")
    return plan


def save_entry(model: CostModel, key: dict, root: str | None = None, plan: dict | None = None) -> str | None:
    """Write `model` (and `plan`, `plan_decisions`) under `key`, atomically; the path, or None when the cache
    directory cannot be written (the next run calibrates again)."""
    path = entry_path(key, root)
    data = {name: getattr(model, name) for name in (*PER_BLOCK, *SCALARS, "host_s")}
    data["measured"] = {k: v for k, v in model.measured.items() if k != "cost_cache"}
    try:
        write_atomic(path, json.dumps({"key": key, "model": data, **({"plan": plan} if plan else {})}))
        return path
    except OSError as e:
        log.info("stagehand: the calibrated cost model was not kept (%s): the next run calibrates again", e)
        return None


def read_entry(key: dict, n_blocks: int, root: str | None = None) -> tuple[CostModel | None, dict | None, str]:
    """(the model kept under `key`, the plan decisions kept beside it, a line for the log): no entry is a plain
    miss, an entry not usable is (None, None, what is wrong with it); unusable decisions are None, the note says
    why, and the model is still used."""
    path = entry_path(key, root)
    if not os.path.exists(path):
        return None, None, "no calibrated cost model kept for this model, precision map, trainable set and input shapes"
    try:
        with open(path) as f:
            entry = json.load(f)
        if not isinstance(entry, dict) or entry.get("key") != key:
            raise ValueError("it holds another key")
        model = _model_from(entry.get("model"), n_blocks)
    except (OSError, ValueError, TypeError, KeyError) as e:
        return None, None, f"cost model cache {path} ignored: {e}"
    model.measured = dict(model.measured, cost_cache=path)
    note = f"calibrated cost model loaded from {path}"
    try:
        plan = _plan_from(entry["plan"], n_blocks) if "plan" in entry else None
    except (ValueError, TypeError, KeyError) as e:
        plan, note = None, f"{note} (its plan ignored: {e})"
    return model, plan, note


def _plan_from(data, n: int) -> dict:
    if not isinstance(data, dict):
        raise ValueError("not a mapping")
    for name in ("resident", "recompute", "spill"):
        values = data[name]
        if not isinstance(values, list) or not all(isinstance(b, int) and 0 <= b < n for b in values):
            raise ValueError(f"{name} is not a list of block numbers below {n}")
    if not isinstance(data["slots"], int) or data["slots"] < 0:
        raise ValueError("slots is not a count")
    budget = data["budget"]
    if not isinstance(budget, list) or len(budget) != 2 or not all(b is None or _number(b) for b in budget):
        raise ValueError("budget is not [soft, hard]")
    return data


def _model_from(data, n: int) -> CostModel:
    if not isinstance(data, dict):
        raise ValueError("no model in it")

    def per_block(name: str, values) -> list:
        if not isinstance(values, list) or len(values) != n or not all(_number(v) for v in values):
            raise ValueError(f"{name} is not {n} finite non-negative numbers")
        return values

    fields = {name: per_block(name, data[name]) for name in PER_BLOCK}
    host = data["host_s"]
    if not isinstance(host, dict) or set(host) != set(HOST_KINDS):
        raise ValueError(f"host_s does not have the kinds {HOST_KINDS}")
    fields["host_s"] = {kind: per_block(f"host_s.{kind}", host[kind]) for kind in HOST_KINDS}
    for name in SCALARS:
        value = data[name]
        if not (value is None and name == "d2h_bps") and not _number(value):
            raise ValueError(f"{name} is not a finite non-negative number")
        fields[name] = value
    measured = data.get("measured", {})
    if not isinstance(measured, dict) or "calibration_step_s" not in measured:
        raise ValueError("it was not measured by a calibration step")
    return CostModel(**fields, measured=dict(measured))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


class KeptCostModel:
    """One runtime's entry in the cache: keyed once the first compiled graph's inputs are known."""

    def __init__(self, job: Callable[[], dict], n_blocks: int):
        self.job, self.n_blocks = job, n_blocks  # job(): `job_key` of the runtime as it is now
        self.inputs: str | None = None  # the first compiled graph's inputs (`GraphRecord.input_shapes`), hashed
        self.note: str | None = None  # what the lookup found (the log line)
        self.plan: dict | None = None  # the plan decisions kept with the loaded model (`plan_decisions`)

    def on_graph(self, input_shapes: list[str], load: bool) -> CostModel | None:
        """The first graph's inputs complete the key; with `load`, the kept model, if one is usable."""
        if self.inputs is not None or not env("STAGEHAND_COST_CACHE"):
            return None
        self.inputs = hashlib.sha256("|".join(input_shapes).encode()).hexdigest()[:16]  # shapes and dtypes
        if not load:
            return None
        model, self.plan, self.note = read_entry(cost_key(self.job(), self.inputs), self.n_blocks)
        (log.warning if "ignored" in self.note else log.info)("stagehand: %s", self.note)
        return model

    def keep(self, model: CostModel, plan: dict | None = None) -> None:
        """Write a measured model with the decisions of the plan in force (`plan_decisions`)."""
        if self.inputs is not None and model.source == MEASURED and not model.frozen:
            save_entry(model, cost_key(self.job(), self.inputs), plan=plan)
