"""Python's garbage collector, out of the steps' way.

Compiling leaves millions of long-lived objects (Dynamo's graphs and guards, Inductor's code) that every full
collection walks. At the end of `offload()` (`freeze_before_compile`: the young generations collected first) and
after each step that compiled units (one full collection first), what exists is frozen (`gc.freeze`), so later
collections walk only what was made since. `rt.restore()` / `close()` unfreeze (the frozen generation is the
process's: that also releases what the script froze itself); a process that exits without them unfreezes at exit
(`atexit`), so extension modules do not report frozen objects as leaked. `Config.freeze_gc_after_compile=False`
leaves the collector alone.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import time
from typing import Any, Callable

from torch_stagehand.runtime.conductor.phases import Phase

log = logging.getLogger(__name__)


class CollectorFreeze:
    def __init__(self, enabled: bool, phases, compiled: Callable[[], int]):
        """`enabled`: Config.freeze_gc_after_compile; `phases`: the tracker whose step ends it listens to;
        `compiled()`: how many units have compiled so far (a step that compiled ends with a freeze)."""
        self.enabled, self.phases, self.compiled = enabled, phases, compiled
        self.freezes: list[dict[str, Any]] = []  # one per freeze: step, objects frozen, ms of the collection
        self._compiled_at_freeze = 0  # compiled() at the last freeze
        self._closed = False
        if enabled:
            phases.listeners.append(self.on_phase)

    def freeze_before_compile(self) -> None:
        """At offload's end: freeze what exists, after a collection of the young generations."""
        if not self._closed and self.enabled:
            self._freeze({"at": "offload"}, generation=1)

    def on_phase(self, old: Phase, new: Phase) -> None:
        if self._closed or new is not Phase.STEP_END or self.compiled() == self._compiled_at_freeze:
            return  # (close() ends an open step after removing its hooks: nothing is frozen then)
        self._compiled_at_freeze = self.compiled()
        # A full collection first: this step's garbage (the compile's) goes, frozen garbage would stay.
        record = self._freeze({"at": "step", "step": self.phases.step})
        log.info("stagehand: after compiling, %d objects moved out of the collector's walks (%.0f ms)",
                 record["frozen_objects"], record["collect_ms"])

    def _freeze(self, record: dict[str, Any], generation: int = 2) -> dict[str, Any]:
        t0 = time.perf_counter()
        gc.collect(generation)
        _unfreeze_at_exit()
        gc.freeze()
        record.update(frozen_objects=gc.get_freeze_count(), collect_ms=round((time.perf_counter() - t0) * 1e3, 1))
        self.freezes.append(record)
        return record

    def remove(self) -> None:
        """At close(): no freeze after this one, and what was frozen (by anything in the process) is collectable."""
        self._closed = True
        if self.freezes:
            gc.unfreeze()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)  # once per process
