"""The transfer manager: separate H2D and D2H slot pools that hand out tokens (conductor.txt).

A copy over PCIe is issued only with a token. A request is answered with a
`TransferToken` or a typed `TransferDenial`: the direction's pool is
exhausted, the phase rules suppress speculative work, or the hints cap the
in-flight copies of that direction below the pool's size. CRITICAL requests
(a block that must compute now) are never denied: correctness first, a stall
at worst. `contention` counts consecutive checks that found the pool full
(rule 3 reads it).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

from torch_stagehand.runtime.conductor.budget import Priority


class Direction(str, enum.Enum):
    H2D = "h2d"
    D2H = "d2h"


class TransferDenial(str, enum.Enum):
    H2D_SLOTS_EXHAUSTED = "h2d_slots_exhausted"
    D2H_SLOTS_EXHAUSTED = "d2h_slots_exhausted"
    PHASE_RULE_SUPPRESSED_SPECULATIVE = "phase_rule_suppressed_speculative"
    H2D_LIMITED_BY_HINT = "h2d_limited_by_hint"
    D2H_LIMITED_BY_HINT = "d2h_limited_by_hint"


@dataclass(frozen=True)
class TransferToken:
    id: int
    direction: Direction
    priority: Priority
    key: object = None  # what the copy is for (a block), so it can be completed by name


class TransferManager:
    def __init__(self, h2d_slots: int, d2h_slots: int):
        self.capacity = {Direction.H2D: h2d_slots, Direction.D2H: d2h_slots}
        self.limits = dict(self.capacity)  # in-flight caps from the hints (never above capacity)
        self.suppress_speculative = False
        self.inflight: dict[Direction, dict[int, TransferToken]] = {d: {} for d in Direction}
        self.contention = 0  # consecutive checks that found a pool full
        self.denials: dict[str, int] = {}
        self._ids = itertools.count(1)

    def request(self, direction: Direction, priority: Priority, key: object = None) -> TransferToken | TransferDenial:
        inflight = self.inflight[direction]
        full = len(inflight) >= self.capacity[direction]
        self.contention = self.contention + 1 if full else 0
        if priority is not Priority.CRITICAL:
            denial = None
            if self.suppress_speculative and priority >= Priority.SPECULATIVE:
                denial = TransferDenial.PHASE_RULE_SUPPRESSED_SPECULATIVE
            elif full:
                denial = (TransferDenial.H2D_SLOTS_EXHAUSTED if direction is Direction.H2D
                          else TransferDenial.D2H_SLOTS_EXHAUSTED)
            elif len(inflight) >= self.limits[direction]:
                denial = (TransferDenial.H2D_LIMITED_BY_HINT if direction is Direction.H2D
                          else TransferDenial.D2H_LIMITED_BY_HINT)
            if denial is not None:
                self.denials[denial.value] = self.denials.get(denial.value, 0) + 1
                return denial
        token = TransferToken(next(self._ids), direction, priority, key)
        inflight[token.id] = token
        return token

    def complete(self, token: TransferToken) -> None:
        self.inflight[token.direction].pop(token.id, None)

    def complete_key(self, direction: Direction, key: object) -> None:
        """Complete every in-flight copy of `key` (the block's wait consumed it)."""
        inflight = self.inflight[direction]
        for token_id in [i for i, t in inflight.items() if t.key == key]:
            del inflight[token_id]

    def reset(self) -> None:
        """A new step: copies of the last one are done (the step's waits ordered them)."""
        for pool in self.inflight.values():
            pool.clear()
        self.contention = 0

    def inflight_count(self, direction: Direction) -> int:
        return len(self.inflight[direction])
