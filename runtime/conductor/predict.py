"""The backward schedule `explain()` prints, predicted from a forward that ran (a real backward would accumulate
gradients): the forward's order reversed, played through a meta twin of the live slot pool (`SlotPool.shadow`).
"""

from __future__ import annotations

from typing import Sequence

from torch_stagehand.runtime.registry import NO_BLOCK

from torch_stagehand.runtime.conductor.fetch_order import FetchOrder
from torch_stagehand.runtime.conductor.trace import TraceRow, recording


def predict_backward(pool, forward_blocks: Sequence[int], precision: dict[int, str], n_blocks: int) -> list[TraceRow]:
    """Trace rows (phase "backward") of the backward that follows a forward which waited on `forward_blocks`."""
    twin = pool.shadow()
    with recording(twin, phase=lambda: "backward") as trace:
        for step in reversed(FetchOrder.for_graph(forward_blocks, n_blocks)):
            twin.acquire(step.block, precision[step.block])
            if step.next_bwd != NO_BLOCK:
                twin.prefetch(step.next_bwd, precision[step.next_bwd])
            twin.release(step.block, precision[step.block])
    return trace.rows
