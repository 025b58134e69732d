"""The plan's prefetch: the block the schedule names next, and up to the plan's lookahead of streamed blocks
after it (resident ones skipped: their weights are there already, so the next streamed block's copy overlaps
their compute), each admitted by the conductor's transfer rules (planning.PlanDriver.prefetch)."""

from __future__ import annotations

import torch

from torch_stagehand.runtime.registry import NO_BLOCK


def prefetch_ahead(driver, block: int) -> None:
    """`driver` (a PlanDriver) fetches `block` and the streamed blocks its plan looks ahead to."""
    rt, plan = driver.rt, driver.plan
    if block == NO_BLOCK:
        return
    if plan is None or plan.kind == "fixed":
        rt.pool.prefetch(block, rt._precision[block])
        return
    backward = torch._C._current_graph_task_id() != -1
    resident = rt.pool.resident_slots
    wanted, b, steps = [], block, 0
    while b != NO_BLOCK and len(wanted) < plan.lookahead and steps < len(rt.blocks):
        if b not in resident:
            wanted.append(b)
        b = rt.fetch_order.eager_next(b, backward)
        steps += 1
    for depth, b in enumerate(wanted):
        precision = rt._precision[b]
        if not driver._admit or rt.pool.cached(b, precision):
            rt.pool.prefetch(b, precision)  # a hit moves nothing: no token needed
            continue
        if driver.conductor.admit_prefetch(b, depth) is not None:
            continue  # denied (counted with its reason): the block's wait fetches it later
        try:
            issued = rt.pool.prefetch(b, precision).issued
        except torch.OutOfMemoryError as e:  # e.g. re-quantizing a stale INT8 copy on the device
            driver.conductor.allocation_failed(b, e)
            rt.oom.note_handled()
            return
        if not issued:
            driver.conductor.copy_not_issued(b)
