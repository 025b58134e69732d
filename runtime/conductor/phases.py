"""Training-step phases (conductor.txt): STEP_BEGIN -> FORWARD -> BACKWARD -> OPTIMIZER -> STEP_END.

From the compiled program (its first forward and backward ops) and the attached optimizer's step hooks; without
an optimizer a forward after a backward starts a new step. Durations are host wall time (the GPU runs behind).
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
        # Asked at each forward op of a block: True (only ever in FORWARD) ends the step there: a new forward
        # began and the last step never reached its backward's blocks (oom_recovery's evidence of a step that raised).
        self.new_forward_checks: list[Callable[[int], bool]] = []

    def _enter(self, phase: Phase) -> None:
        now = time.perf_counter()
        if self.phase not in (Phase.IDLE, Phase.STEP_END):
            self.durations[self.phase.value] = self.durations.get(self.phase.value, 0.0) + now - self._since
        old, self.phase, self._since = self.phase, phase, now
        for listener in self.listeners:
            listener(old, phase)

    def forward_op(self, block: int | None = None) -> None:
        if block is not None and any(check(block) for check in self.new_forward_checks):
            self.end_step()
        if self.phase in (Phase.BACKWARD, Phase.OPTIMIZER):
            self.end_step()  # no optimizer attached (or it never stepped): a new step begins
        if self.phase in (Phase.IDLE, Phase.STEP_END):
            self._enter(Phase.STEP_BEGIN)
        if self.phase is not Phase.FORWARD:
            self._enter(Phase.FORWARD)

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
