"""Seconds per stage of offload, for its report (`rt.stats()["offload"]`): the calling thread's stages one after
another (`mark`), and work on other threads beside them (`beside`), so the report shows what a stage waited for."""

from __future__ import annotations

import time

# The calling thread's work beside the host store's fill, by the name the report reads.
COMPILER_PREPARATION = "compiler imports and source index"
# The compiler's files read ahead of a slab's reads (compiler/startup/read_ahead.py); " (the wait)": the reads' wait.
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
