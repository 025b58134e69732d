"""The run-time Conductor: phases in, hints out, every prefetch admitted or denied with a reason (conductor.txt).

Disabled it allocates nothing and `PlanDriver` never calls it. Enabled: a `BudgetManager` reserves the plan's
device memory (resident blocks and the computing block's slot CRITICAL, the next REQUIRED, deeper ones SPECULATIVE;
a slot not granted shortens the window), a `TransferManager` hands out the H2D token every prefetch needs, and
`PrefetchRules`'s hints are recomputed at each phase change and admission. A denied prefetch is fetched by the
block's `wait`: a stall, never a stale slot.
"""

from __future__ import annotations

import enum
import itertools
import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

log = logging.getLogger(__name__)

WINDOW_CAP = "prefetch_window_cap"  # a denial reason of the conductor's own: deeper than the hints allow
BACKWARD, OPTIMIZER = "backward", "optimizer"


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
    """Device-memory reservations by mode and priority (conductor.txt). HARD: all of it under the soft cap or
    nothing; SOFT: what is left under the soft cap (partial) or nothing; BURST: all of it under the hard cap or
    nothing; FLOOR: a guaranteed minimum granted as BURST is; CEILING: no bytes, an upper bound on what its owner
    may hold from now on. CRITICAL may always use up to the hard cap; SPECULATIVE and BACKGROUND leave `headroom`
    free under the soft cap for the REQUIRED work that follows. `used`: the reservations plus `external()`, the
    device memory the manager does not reserve, read without blocking the host."""

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
        if priority is Priority.CRITICAL or mode in (BudgetMode.BURST, BudgetMode.FLOOR):
            if used + nbytes > self.hard_cap:
                return self._deny(BudgetDenial.HARD_CAP_EXCEEDED)
            return self._grant(owner, nbytes, nbytes, mode, priority, phase)
        left = self.soft_cap - (self.headroom if priority >= Priority.SPECULATIVE else 0) - used
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
        kept = {i: r for i, r in self.reservations.items() if r.phase != phase}
        ended, self.reservations = len(self.reservations) - len(kept), kept
        return ended

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
    """Separate H2D and D2H pools of tokens; a PCIe copy is issued only with one (conductor.txt). A request gets a
    `TransferToken` or a `TransferDenial` (pool exhausted, speculative work suppressed, or the hints' cap); CRITICAL
    requests are never denied. `contention` counts consecutive checks that found the pool full (rule 3)."""

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
                denial = TransferDenial(f"{direction.value}_slots_exhausted")
            elif len(inflight) >= self.limits[direction]:
                denial = TransferDenial(f"{direction.value}_limited_by_hint")
            if denial is not None:
                self.denials[denial.value] = self.denials.get(denial.value, 0) + 1
                return denial
        token = TransferToken(next(self._ids), direction, priority, key)
        inflight[token.id] = token
        return token

    def complete_key(self, direction: Direction, key: object) -> None:
        """Complete every in-flight copy of `key` (the block's wait consumed it)."""
        self.inflight[direction] = {i: t for i, t in self.inflight[direction].items() if t.key != key}

    def reset(self) -> None:
        """A new step: copies of the last one are done (the step's waits ordered them)."""
        for pool in self.inflight.values():
            pool.clear()
        self.contention = 0


@dataclass(frozen=True)
class RuntimeLimitHints:
    max_inflight_h2d: int
    max_inflight_d2h: int
    prefetch_window_cap: int
    suppress_speculative: bool = False
    reasons: tuple[str, ...] = field(default=())

    def tighten(self, other: "RuntimeLimitHints") -> "RuntimeLimitHints":
        """The stricter of the two, field by field (what monotonic means)."""
        reasons = self.reasons + tuple(r for r in other.reasons if r not in self.reasons)
        return RuntimeLimitHints(min(self.max_inflight_h2d, other.max_inflight_h2d),
                                 min(self.max_inflight_d2h, other.max_inflight_d2h),
                                 min(self.prefetch_window_cap, other.prefetch_window_cap),
                                 self.suppress_speculative or other.suppress_speculative, reasons)

    def as_dict(self) -> dict:
        return {**asdict(self), "reasons": list(self.reasons)}


class PrefetchRules:
    """The seed's three rules as limit hints, which only tighten within a step. 1: in BACKWARD above the pressure
    threshold, speculative prefetch stops and the window drops to 1. 2: in OPTIMIZER, speculative work stops and H2D
    is limited to one copy in flight. 3: a pool found full on more than `contention_checks` consecutive checks shrinks
    the window by one (to 1 at least). `reset()` returns the plan's values; `shrink(reason)` tightens the window."""

    def __init__(self, h2d_slots: int, d2h_slots: int, window: int, pressure_threshold: float = 0.8,
                 contention_checks: int = 3):
        self.base = RuntimeLimitHints(h2d_slots, d2h_slots, max(window, 1))
        self.pressure_threshold = pressure_threshold
        self.contention_checks = contention_checks
        self.hints = self.base

    def set_window(self, window: int) -> None:
        """The plan changed its lookahead: the base the next `reset` returns to."""
        self.base = replace(self.base, prefetch_window_cap=max(window, 1))

    def reset(self) -> RuntimeLimitHints:
        self.hints = self.base
        return self.hints

    def update(self, phase: str, pressure: float, contention: int) -> RuntimeLimitHints:
        if phase == BACKWARD and pressure > self.pressure_threshold:
            self._tighten(prefetch_window_cap=1, suppress_speculative=True, reasons=("backward_pressure",))
        if phase == OPTIMIZER:
            self._tighten(max_inflight_h2d=1, suppress_speculative=True, reasons=("optimizer_phase",))
        if contention > self.contention_checks:
            self.shrink("contention")
        return self.hints

    def shrink(self, reason: str) -> RuntimeLimitHints:
        return self._tighten(prefetch_window_cap=max(1, self.hints.prefetch_window_cap - 1), reasons=(reason,))

    def _tighten(self, **changes) -> RuntimeLimitHints:
        self.hints = self.hints.tighten(replace(self.hints, **changes))
        return self.hints


class Conductor:
    def __init__(self, config, soft_cap: int | None = None, hard_cap: int | None = None,
                 pressure: Callable[[], float] | None = None, external: Callable[[], int] = lambda: 0):
        self.enabled = bool(config.enabled)
        if not self.enabled:
            return  # zero-cost disable: nothing below is allocated
        self.config = config
        self.budget = BudgetManager(soft_cap, hard_cap, external=external)
        self.transfers = TransferManager(config.h2d_slots, config.d2h_slots)
        self.policy = PrefetchRules(config.h2d_slots, config.d2h_slots, config.prefetch_window,
                                    config.backward_pressure_threshold, config.contention_checks)
        self._pressure = pressure or self.budget.pressure
        self.phase = "idle"
        self.hints: RuntimeLimitHints = self.policy.reset()
        self.denials: dict[str, int] = {}
        self.window_notes: list[str] = []  # why the window shrank (allocation failures, budget denials)
        self.events: list[dict] | None = [] if config.debug_event_trace else None
        self._plan_reservations: list = []

    def reserve_plan(self, resident_bytes: list[int], slot_bytes: int, slots: int, window: int) -> int:
        """Reserve the plan's device memory; returns the window the granted slots allow."""
        for r in self._plan_reservations:
            self.budget.release(r)
        self._plan_reservations = [self.budget.request("resident", nbytes, BudgetMode.FLOOR, Priority.CRITICAL)
                                   for nbytes in resident_bytes]
        granted = 0
        for i in range(slots):
            priority = Priority.CRITICAL if i == 0 else Priority.REQUIRED if i == 1 else Priority.SPECULATIVE
            grant = self.budget.request("slots", slot_bytes, BudgetMode.HARD, priority)
            if not grant:
                self._note(f"slot {i} ({priority.name}) not granted: {grant.denial.value}; window cut to "
                           f"{max(granted - 1, 1)}")
                break
            self._plan_reservations.append(grant)
            granted += 1
        allowed = min(window, max(granted - 1, 1)) if slots else 0
        # One H2D token per copy the window keeps in flight (the plan sized the slots for them).
        self.transfers.capacity[Direction.H2D] = max(allowed, 1)
        self.policy.set_window(allowed)
        self.hints = self.policy.hints.tighten(self.policy.base) if self.phase != "idle" else self.policy.reset()
        return allowed

    def on_phase(self, phase: str) -> None:
        previous, self.phase = self.phase, phase
        self.budget.end_phase(previous)
        if phase == "step_begin":
            self.transfers.reset()
            self.hints = self.policy.reset()
        else:
            self._update()
        self._event("phase", phase=phase)

    def _update(self) -> None:
        self.hints = self.policy.update(self.phase, self._pressure(), self.transfers.contention)
        self.transfers.limits[Direction.H2D] = self.hints.max_inflight_h2d
        self.transfers.limits[Direction.D2H] = self.hints.max_inflight_d2h
        self.transfers.suppress_speculative = self.hints.suppress_speculative

    def admit_prefetch(self, block: int, depth: int) -> str | None:
        """None if the prefetch `depth` blocks ahead (0: the next block) may copy now, else the denial reason."""
        priority = Priority.REQUIRED if depth == 0 else Priority.SPECULATIVE
        self._update()
        if depth >= self.hints.prefetch_window_cap:
            return self._deny(WINDOW_CAP, block)
        answer = self.transfers.request(Direction.H2D, priority, key=block)
        if isinstance(answer, TransferDenial):
            return self._deny(answer.value, block)
        self._event("h2d_token", block=block, priority=priority.name)
        return None

    def copy_consumed(self, block: int) -> None:
        """The block's H2D token is free: its wait consumed the copy, or the prefetch was not issued."""
        self.transfers.complete_key(Direction.H2D, block)

    def allocation_failed(self, block: int, error: BaseException) -> None:
        """A prefetch could not allocate: shrink the window and say so; the step goes on."""
        self.copy_consumed(block)
        self.hints = self.policy.shrink("allocation_failed")
        self._note(f"prefetch of block {block} could not allocate ({type(error).__name__}); prefetch window "
                   f"cut to {self.hints.prefetch_window_cap}, the block is fetched at its wait")
        self._deny("allocation_failed", block)

    def _note(self, note: str) -> None:
        self.window_notes.append(note)
        log.warning("stagehand conductor: %s", note)

    def _deny(self, reason: str, block: int) -> str:
        self.denials[reason] = self.denials.get(reason, 0) + 1
        self._event("denied", block=block, reason=reason)
        return reason

    def _event(self, kind: str, **fields) -> None:
        if self.events is not None:
            self.events.append({"event": kind, "phase": self.phase, **fields})

    def snapshot(self) -> dict:
        b = self.budget
        return {"hints": self.hints.as_dict(), "conductor_denials": dict(self.denials),
                "budget": {"reserved_mb": round(b.reserved / 2**20, 1), "pressure": round(self._pressure(), 4),
                           "grant_count": b.grants, "deny_count": b.denials, "partial_count": b.partials},
                "h2d_inflight": len(self.transfers.inflight[Direction.H2D]),
                "d2h_inflight": len(self.transfers.inflight[Direction.D2H])}
