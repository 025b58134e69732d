"""The schedule trace: what the slot pool did, one row per decision, for `explain()` (a record, not a replay).

The `SlotPool` reports each decision (prefetch, wait, eager fetch, evict, and how it went) to its `trace` when one
is set (off by default: one `is not None` check per decision); `recording(pool)` sets one around a call. A trace
keeps its first `capacity` rows and counts the rest.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

# What a row did: the kind of pool call.
PREFETCH, WAIT, EAGER, EVICT = "prefetch", "wait", "eager", "evict"
# How it went.
H2D_COPY = "h2d_copy"  # a copy was issued ahead of the wait (prefetch)
SYNC_FETCH = "sync_fetch"  # a wait / eager read found nothing and had to copy now (a stall)
HIT = "hit"  # the block was already resident: no copy
IN_FLIGHT = "in_flight"  # a wait found the copy a prefetch issued
DENIED = "denied"  # a prefetch was not issued; `reason` says why
RELEASED = "released"  # an evict dropped the hold (the bytes stay for reuse)
NOT_HELD = "not_held"  # an evict found nothing held (a block split by a graph break releases once per part)

DEFAULT_CAPACITY = 4096


def autograd_direction() -> str:
    """"backward" inside autograd's backward (checkpoint recomputation included), else "forward"."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


@dataclass(frozen=True)
class TraceRow:
    phase: str  # "forward" / "backward": the pass the decision ran in
    action: str  # PREFETCH / WAIT / EAGER / EVICT
    block: int
    slot: int | None
    bytes: int
    precision: str
    outcome: str  # H2D_COPY / SYNC_FETCH / HIT / IN_FLIGHT / DENIED / RELEASED / NOT_HELD
    reason: str = ""  # a denial's reason

    @property
    def copied(self) -> bool:
        """Whether this row moved bytes host -> device."""
        return self.outcome in (H2D_COPY, SYNC_FETCH)


class ScheduleTrace:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, phase: Callable[[], str] = autograd_direction):
        self.capacity = capacity
        self.rows: list[TraceRow] = []
        self.dropped = 0
        self._phase = phase

    def record(self, action: str, block: int, precision: str, slot: int | None, nbytes: int,
               outcome: str, reason: str = "") -> None:
        if len(self.rows) >= self.capacity:
            self.dropped += 1
            return
        self.rows.append(TraceRow(self._phase(), action, block, slot, nbytes, precision, outcome, reason))

    def count(self, action: str | None = None, outcome: str | None = None) -> int:
        return sum(1 for r in self.rows if (action is None or r.action == action)
                   and (outcome is None or r.outcome == outcome))

    def __len__(self) -> int:
        return len(self.rows)


@contextmanager
def recording(pool, capacity: int = DEFAULT_CAPACITY, phase: Callable[[], str] = autograd_direction
              ) -> Iterator[ScheduleTrace]:
    """Trace what `pool` does inside the block; the previous trace (usually none) is put back after."""
    trace = ScheduleTrace(capacity, phase)
    previous, pool.trace = pool.trace, trace
    try:
        yield trace
    finally:
        pool.trace = previous
