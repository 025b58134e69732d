"""The budget manager: device-memory reservations with modes and priorities (conductor.txt).

A reservation asks for bytes under one of five modes:

| mode    | grant                                                                 |
|---------|-----------------------------------------------------------------------|
| HARD    | all of it under the soft cap, or nothing                              |
| SOFT    | what is left under the soft cap (a partial grant), or nothing if none |
| BURST   | all of it under the hard cap (may cross the soft cap), or nothing     |
| FLOOR   | a guaranteed minimum: all of it under the hard cap, or nothing; floors are never counted as free |
| CEILING | no bytes: an upper bound on what its owner may hold from now on        |

and a priority, CRITICAL > REQUIRED > SPECULATIVE > BACKGROUND. CRITICAL (the
block that must compute now) may always use up to the hard cap, whatever the
mode; SPECULATIVE and BACKGROUND must leave `headroom` bytes free under the
soft cap for the REQUIRED work that follows. Every refusal carries a typed
`BudgetDenial`. Reservations may be phase-scoped: `end_phase(phase)` drops
them. `used` is the reserved bytes plus `external()`, the device memory the
manager does not reserve itself (activations, everything else), read without
blocking the host.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Callable


class BudgetMode(enum.Enum):
    HARD = "hard"
    SOFT = "soft"
    BURST = "burst"
    FLOOR = "floor"
    CEILING = "ceiling"


class Priority(enum.IntEnum):
    """Lower value, higher priority (CRITICAL > REQUIRED > SPECULATIVE > BACKGROUND)."""

    CRITICAL = 0
    REQUIRED = 1
    SPECULATIVE = 2
    BACKGROUND = 3


class BudgetDenial(str, enum.Enum):
    SOFT_CAP_EXCEEDED = "soft_cap_exceeded"
    HARD_CAP_EXCEEDED = "hard_cap_exceeded"
    HEADROOM_RESERVED = "headroom_reserved_for_higher_priority"
    CEILING_EXCEEDED = "ceiling_exceeded"
    NOTHING_LEFT = "nothing_left_under_the_soft_cap"


@dataclass
class Reservation:
    id: int
    owner: str
    nbytes: int  # granted
    requested: int
    mode: BudgetMode
    priority: Priority
    phase: str | None = None  # released when this phase ends


@dataclass
class Grant:
    reservation: Reservation | None
    denial: BudgetDenial | None = None

    @property
    def granted(self) -> int:
        return 0 if self.reservation is None else self.reservation.nbytes

    @property
    def partial(self) -> bool:
        return self.reservation is not None and self.reservation.nbytes < self.reservation.requested

    def __bool__(self) -> bool:
        return self.reservation is not None


class BudgetManager:
    def __init__(self, soft_cap: int | None, hard_cap: int | None, headroom: int = 0,
                 external: Callable[[], int] = lambda: 0):
        self.hard_cap = hard_cap if hard_cap is not None else soft_cap
        self.soft_cap = soft_cap if soft_cap is not None else self.hard_cap
        self.headroom = headroom
        self.external = external
        self.reservations: dict[int, Reservation] = {}
        self.ceilings: dict[str, int] = {}
        self._ids = itertools.count(1)
        self.grants = self.denials = self.partials = 0

    @property
    def reserved(self) -> int:
        return sum(r.nbytes for r in self.reservations.values())

    @property
    def used(self) -> int:
        return self.reserved + self.external()

    def pressure(self) -> float:
        """Used bytes over the hard cap (0 without caps)."""
        return self.used / self.hard_cap if self.hard_cap else 0.0

    def held_by(self, owner: str) -> int:
        return sum(r.nbytes for r in self.reservations.values() if r.owner == owner)

    def request(self, owner: str, nbytes: int, mode: BudgetMode = BudgetMode.HARD,
                priority: Priority = Priority.REQUIRED, phase: str | None = None) -> Grant:
        if mode is BudgetMode.CEILING:
            self.ceilings[owner] = nbytes
            return self._grant(owner, 0, nbytes, mode, priority, phase)
        ceiling = self.ceilings.get(owner)
        if ceiling is not None and self.held_by(owner) + nbytes > ceiling and mode is not BudgetMode.SOFT:
            return self._deny(BudgetDenial.CEILING_EXCEEDED)
        if self.hard_cap is None:  # no caps: everything is granted (the manager only counts)
            return self._grant(owner, nbytes, nbytes, mode, priority, phase)
        used = self.used
        soft = self.soft_cap - (self.headroom if priority >= Priority.SPECULATIVE else 0)
        if priority is Priority.CRITICAL or mode in (BudgetMode.BURST, BudgetMode.FLOOR):
            if used + nbytes > self.hard_cap:
                return self._deny(BudgetDenial.HARD_CAP_EXCEEDED)
            return self._grant(owner, nbytes, nbytes, mode, priority, phase)
        left = soft - used
        if ceiling is not None:
            left = min(left, ceiling - self.held_by(owner))
        if mode is BudgetMode.SOFT:
            if left <= 0:
                return self._deny(BudgetDenial.NOTHING_LEFT)
            return self._grant(owner, min(nbytes, left), nbytes, mode, priority, phase)
        if nbytes > left:  # HARD
            within_soft = used + nbytes <= self.soft_cap
            return self._deny(BudgetDenial.HEADROOM_RESERVED if within_soft else BudgetDenial.SOFT_CAP_EXCEEDED)
        return self._grant(owner, nbytes, nbytes, mode, priority, phase)

    def release(self, reservation: Reservation | Grant | None) -> None:
        if isinstance(reservation, Grant):
            reservation = reservation.reservation
        if reservation is not None:
            self.reservations.pop(reservation.id, None)

    def end_phase(self, phase: str) -> int:
        """Drop the reservations scoped to `phase`; returns how many."""
        ended = [i for i, r in self.reservations.items() if r.phase == phase]
        for i in ended:
            del self.reservations[i]
        return len(ended)

    def _grant(self, owner, nbytes, requested, mode, priority, phase) -> Grant:
        r = Reservation(next(self._ids), owner, nbytes, requested, mode, priority, phase)
        if mode is not BudgetMode.CEILING:
            self.reservations[r.id] = r
        self.grants += 1
        self.partials += nbytes < requested
        return Grant(r)

    def _deny(self, reason: BudgetDenial) -> Grant:
        self.denials += 1
        return Grant(None, reason)
