"""The schedule as a table: what the compiled program will do, step by step.

The rows come from the linked outer graphs (which block units run, in which
order, with which precision) played through the *same* slot state machine
the runtime uses (`SlotPool` on the meta device: no bytes move), so slot
numbers, hits and fetches are what the runtime's policy will produce. The
backward half is the forward's block order reversed, as the backward
schedule pass emits it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_stagehand.runtime import registry
from torch_stagehand.runtime.slots import SlotPool

from .units import BlockUnit


@dataclass
class ScheduleRow:
    phase: str
    position: int
    action: str
    block: int
    slot: int | None
    bytes: int
    precision: str
    note: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def block_order(records) -> list[tuple[int, int]]:
    """(block, next block) for every block unit the forward runs, in order."""
    order = []
    for record in records:
        for node in record.outer.graph.nodes:
            if node.op == "call_module" and isinstance(record.outer.get_submodule(node.target), BlockUnit):
                unit = record.outer.get_submodule(node.target)
                next_token = getattr(record.outer, node.args[-2].target)  # the unit's next_tok get_attr
                order.append((unit.block, registry.decode(next_token)[1]))
    return order


def simulate(rt, records, with_backward: bool) -> list[ScheduleRow]:
    pool = SlotPool(torch.device("meta"), len(rt.pool.slots), rt.pool.slot_bytes, rt.store)
    rows: list[ScheduleRow] = []
    order = block_order(records)

    def row(phase: str, action: str, block: int, note: str = "") -> None:
        precision = rt.precision[block]
        slot = next((s.index for s in pool.slots if s.key == (block, precision)), None)
        rows.append(ScheduleRow(phase, len(rows), action, block, slot, rt.block_nbytes(block, precision), precision, note))

    def prefetch(phase: str, block: int) -> None:
        if block == registry.NO_BLOCK:
            return
        before = pool.stats.fetches
        outcome = pool.prefetch(block, rt.precision[block])
        note = "denied: " + outcome.denial.value if outcome.denial else ("H2D copy" if pool.stats.fetches > before else "resident")
        row(phase, "prefetch", block, note)

    def wait(phase: str, block: int) -> None:
        before = pool.stats.sync_fetches
        pool.acquire(block, rt.precision[block], hold=True)
        row(phase, "wait", block, "sync fetch (stall)" if pool.stats.sync_fetches > before else "")

    def evict(phase: str, block: int) -> None:
        row(phase, "evict", block, "slot released, bytes kept")
        pool.release(block, rt.precision[block])

    previous_next = None
    for block, next_block in order:
        if previous_next != block:
            prefetch("forward", block)
        wait("forward", block)
        prefetch("forward", next_block)
        evict("forward", block)
        previous_next = next_block
    if with_backward:
        blocks = [b for b, _ in order]
        for i in range(len(blocks) - 1, -1, -1):
            wait("backward", blocks[i])
            if i > 0:
                prefetch("backward", blocks[i - 1])
            evict("backward", blocks[i])
    return rows
