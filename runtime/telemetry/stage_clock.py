"""Seconds per stage of offload, for its report (`rt.stats()["offload"]["seconds"]`) and the start-time bench.

Offload's stages run one after another on the calling thread (`mark`); some work runs beside a stage on
other threads (the slab's reads beside the compiler's imports): `beside` records how long each took, so
the report shows which one the stage waited for.
"""

from __future__ import annotations

import time

# What offload's calling thread does beside the host store's fill (the slab's reads or the weights' copies), as
# `beside` records it: the bench and the report read it by this name.
COMPILER_PREPARATION = "compiler imports and source index"
# Its files read before a slab's reads begin (compiler/startup/read_ahead.py): on a thread of its own, beside the stages
# before the reads; the stage of this name (and " (the wait)") is what the reads waited for it.
FILES_READ_AHEAD = "compiler's files read ahead"


class StageClock:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.overlapped: dict[str, float] = {}
        self._t0 = self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        """`stage` ended now: it took the seconds since the last mark."""
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now

    def beside(self, work: str, seconds: float) -> None:
        self.overlapped[work] = self.overlapped.get(work, 0.0) + seconds

    def done(self) -> dict[str, float]:
        return {**self.seconds, "total": time.perf_counter() - self._t0}
