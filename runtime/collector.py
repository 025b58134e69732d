"""Python's garbage collector, out of the steps' way.

Compiling a model leaves millions of long-lived Python objects (Dynamo's
graphs and guards, Inductor's code, the FX nodes). A full collection walks all
of them: in the 2000-step soak of the Qwen2.5-7B shape it took 500-720 ms, a
step of 170-200 ms that once every few hundred steps became 670-925 ms (and on
several ranks, one rank's pause stalls them all). After a step that compiled
units, the runtime collects once (that step's garbage) and freezes what is
left (`gc.freeze`): the collector then only walks objects made since, and later
full collections cost a few milliseconds.

The first freeze comes earlier, at the end of `offload()` (`freeze_before_compile`): what exists by then (the
imported libraries, the model, the host store) leaves the walks before the first step compiles. Dynamo's and
Inductor's allocations otherwise set off full collections over all of it during that step (a warm tiny Flux
start on the CPU machine: three, 0.8 s together, one of its 6 s), and the collect after it walks it again.
Only the young generations are collected before that freeze (they are what offload just made): older cyclic
garbage, which importing and building a model rarely leave, waits for the unfreeze. A process that exits
without `restore()` unfreezes at exit (`atexit`): the interpreter's last collections skip frozen objects, and
extension modules then report what they still hold as leaked (nanobind, Triton's bindings: dozens of lines
after a script's own error message).

Objects frozen here that later become cyclic garbage wait for `gc.unfreeze`,
which `rt.restore()` / `close()` call: what the run compiled is collectable
again once the model is put back. The frozen generation is the process's: the
unfreeze also releases what the script froze itself, and a run that never
calls `restore()` keeps the heap frozen to its exit (as vLLM does after its
start). `Config.freeze_gc_after_compile=False` leaves the collector alone.
"""

from __future__ import annotations

import atexit
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
        """At offload's end (module docstring): freeze what exists, after a collection of the young generations."""
        if self._closed or not self.enabled:
            return
        t0 = time.perf_counter()
        gc.collect(1)
        _freeze()
        self.freezes.append({"at": "offload", "frozen_objects": gc.get_freeze_count(),
                             "collect_ms": round((time.perf_counter() - t0) * 1e3, 1)})

    def on_phase(self, old: Phase, new: Phase) -> None:
        if self._closed or new is not Phase.STEP_END or self.compiled() == self._compiled_at_freeze:
            return  # (close() ends an open step after removing its hooks: nothing is frozen then)
        self._compiled_at_freeze = self.compiled()
        t0 = time.perf_counter()
        gc.collect()  # this step's garbage (the compile's) goes first: frozen garbage would stay
        _freeze()
        record = {"at": "step", "step": self.phases.step, "frozen_objects": gc.get_freeze_count(),
                  "collect_ms": round((time.perf_counter() - t0) * 1e3, 1)}
        self.freezes.append(record)
        log.info("stagehand: after compiling, %d objects moved out of the collector's walks (%.0f ms)",
                 record["frozen_objects"], record["collect_ms"])

    def remove(self) -> None:
        """At close(): no freeze after this one, and what was frozen (by this runtime, or anything else in the
        process: the collector has one frozen generation) is collectable again."""
        self._closed = True
        if self.freezes:
            gc.unfreeze()


_unfreeze_at_exit = []  # one atexit registration per process


def _freeze() -> None:
    """gc.freeze(), with the heap unfrozen again when the process exits (module docstring)."""
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit.append(True)
    gc.freeze()
