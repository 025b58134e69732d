"""Training-step phases, as conductor.txt defines them.

STEP_BEGIN -> FORWARD -> BACKWARD -> OPTIMIZER -> STEP_END come from the
compiled program itself (the first scheduled forward op, the first backward
op) and from the attached optimizer's step hooks. Without an optimizer a
forward that follows a backward starts a new step. Durations are host-side
wall time between transitions (the GPU runs asynchronously behind them).
"""

from __future__ import annotations

import enum
import time
from typing import Callable


class Phase(enum.Enum):
    IDLE = "idle"
    STEP_BEGIN = "step_begin"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    STEP_END = "step_end"


class PhaseTracker:
    def __init__(self, on_step_end: Callable[[int, dict[str, float]], None] | None = None):
        self.phase = Phase.IDLE
        self.step = 0
        self._since = time.perf_counter()
        self.durations: dict[str, float] = {}
        self._on_step_end = on_step_end
        self.listeners: list[Callable[[Phase, Phase], None]] = []
        self._forward_blocks: tuple[int, int] | None = None  # (first, last) block this forward waited for

    def _enter(self, phase: Phase) -> None:
        now = time.perf_counter()
        if self.phase not in (Phase.IDLE, Phase.STEP_END):
            key = self.phase.value
            self.durations[key] = self.durations.get(key, 0.0) + now - self._since
        old, self.phase, self._since = self.phase, phase, now
        for listener in self.listeners:
            listener(old, phase)

    def forward_op(self, block: int | None = None) -> None:
        if self.phase is Phase.FORWARD and block is not None and self._forward_blocks is not None:
            first, last = self._forward_blocks
            if block == first and last != block:
                # The forward's first block again: a new forward, the last one never reached a block's backward
                # (a forward only, or a backward that raised before its first block: the loss's own backward)
                self.end_step()
        if self.phase in (Phase.IDLE, Phase.STEP_END):
            self._enter(Phase.STEP_BEGIN)
        elif self.phase in (Phase.BACKWARD, Phase.OPTIMIZER):
            self.end_step()  # no optimizer attached (or it never stepped): a new step begins
            self._enter(Phase.STEP_BEGIN)
        if self.phase is not Phase.FORWARD:
            self._enter(Phase.FORWARD)
            self._forward_blocks = None
        if block is not None:
            self._forward_blocks = (block if self._forward_blocks is None else self._forward_blocks[0], block)

    def backward_op(self) -> None:
        if self.phase is not Phase.BACKWARD:
            self._enter(Phase.BACKWARD)

    def optimizer_begin(self) -> None:
        self._enter(Phase.OPTIMIZER)

    def end_step(self) -> None:
        if self.phase in (Phase.IDLE, Phase.STEP_END):
            return
        self._enter(Phase.STEP_END)
        durations, self.durations = self.durations, {}
        if self._on_step_end is not None:
            self._on_step_end(self.step, durations)
        self.step += 1
