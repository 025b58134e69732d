"""The run-time Conductor: phases in, hints out, every prefetch admitted or denied with a reason.

`Conductor(config, ...)` with `enabled: false` stores that and returns: no
budget manager, no transfer manager, no policy, nothing allocated; the
runtime then never calls it on the hot path (`PlanDriver` checks one
attribute). Enabled, it holds:

- a `BudgetManager` (budget.py) that reserves the plan's device memory: each
  resident block and the slot the computing block reads CRITICAL, the slot of
  the next block REQUIRED, the deeper prefetch slots SPECULATIVE; a slot it
  cannot grant shortens the plan's window, and says so;
- a `TransferManager` (transfer.py) whose H2D tokens every prefetch copy needs;
- the policy bridge (policy.py) whose hints are recomputed at each phase
  change and each admission check, without blocking the host (pressure is
  the allocator's counter, a host read).

A denied prefetch is simply not issued: the block's `wait` fetches it later
(CRITICAL, never denied), so a denial costs a stall, never a stale slot.
"""

from __future__ import annotations

import logging
from typing import Callable

from torch_stagehand.runtime.conductor.budget import BudgetManager, BudgetMode, Priority
from torch_stagehand.runtime.conductor.policy import HeuristicPolicyBridgeV0, RuntimeLimitHints
from torch_stagehand.runtime.conductor.transfer import Direction, TransferDenial, TransferManager

log = logging.getLogger(__name__)

WINDOW_CAP = "prefetch_window_cap"  # a denial reason of the conductor's own: deeper than the hints allow


class Conductor:
    def __init__(self, config, soft_cap: int | None = None, hard_cap: int | None = None,
                 pressure: Callable[[], float] | None = None, external: Callable[[], int] = lambda: 0):
        self.enabled = bool(config.enabled)
        if not self.enabled:
            return  # zero-cost disable: nothing below is allocated
        self.config = config
        self.budget = BudgetManager(soft_cap, hard_cap, external=external)
        self.transfers = TransferManager(config.h2d_slots, config.d2h_slots)
        self.policy = HeuristicPolicyBridgeV0(config.h2d_slots, config.d2h_slots, config.prefetch_window,
                                              config.backward_pressure_threshold, config.contention_checks)
        self._pressure = pressure or self.budget.pressure
        self.phase = "idle"
        self.hints: RuntimeLimitHints = self.policy.reset()
        self.denials: dict[str, int] = {}
        self.window_notes: list[str] = []  # why the window shrank (allocation failures, budget denials)
        self.events: list[dict] | None = [] if config.debug_event_trace else None
        self._plan_reservations: list = []

    # ---- the plan's memory --------------------------------------------------------------------

    def reserve_plan(self, resident_bytes: list[int], slot_bytes: int, slots: int, window: int) -> int:
        """Reserve the plan's device memory; returns the window the granted slots allow."""
        for r in self._plan_reservations:
            self.budget.release(r)
        self._plan_reservations = []
        for nbytes in resident_bytes:
            self._plan_reservations.append(self.budget.request("resident", nbytes, BudgetMode.FLOOR, Priority.CRITICAL))
        granted = 0
        for i in range(slots):
            priority = Priority.CRITICAL if i == 0 else Priority.REQUIRED if i == 1 else Priority.SPECULATIVE
            grant = self.budget.request("slots", slot_bytes, BudgetMode.HARD, priority)
            if not grant:
                note = f"slot {i} ({priority.name}) not granted: {grant.denial.value}; window cut to {max(granted - 1, 1)}"
                self.window_notes.append(note)
                log.warning("stagehand conductor: %s", note)
                break
            self._plan_reservations.append(grant)
            granted += 1
        allowed = min(window, max(granted - 1, 1)) if slots else 0
        # One H2D token per copy the window keeps in flight (the plan sized the slots for them).
        self.transfers.capacity[Direction.H2D] = max(allowed, 1)
        self.policy.set_window(allowed)
        self.hints = self.policy.hints.tighten(self.policy.base) if self.phase != "idle" else self.policy.reset()
        return allowed

    # ---- phases and hints -----------------------------------------------------------------------

    def on_phase(self, phase: str) -> None:
        previous, self.phase = self.phase, phase
        self.budget.end_phase(previous)
        if phase == "step_begin":
            self.transfers.reset()
            self.hints = self.policy.reset()
        else:
            self._update()
        self._event("phase", phase=phase)

    def _update(self) -> RuntimeLimitHints:
        self.hints = self.policy.update(self.phase, self._pressure(), self.transfers.contention)
        self.transfers.limits[Direction.H2D] = self.hints.max_inflight_h2d
        self.transfers.limits[Direction.D2H] = self.hints.max_inflight_d2h
        self.transfers.suppress_speculative = self.hints.suppress_speculative
        return self.hints

    # ---- admission ------------------------------------------------------------------------------

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
        """The block's wait ordered the compute after its copy: its H2D token is free."""
        self.transfers.complete_key(Direction.H2D, block)

    def copy_not_issued(self, block: int) -> None:
        """An admitted prefetch found the block resident (or failed): give its token back."""
        self.transfers.complete_key(Direction.H2D, block)

    def allocation_failed(self, block: int, error: BaseException) -> None:
        """A prefetch could not allocate: shrink the window and say so; the step goes on."""
        self.copy_not_issued(block)
        self.hints = self.policy.shrink("allocation_failed")
        note = (f"prefetch of block {block} could not allocate ({type(error).__name__}); prefetch window "
                f"cut to {self.hints.prefetch_window_cap}, the block is fetched at its wait")
        self.window_notes.append(note)
        log.warning("stagehand conductor: %s", note)
        self._deny("allocation_failed", block)

    def _deny(self, reason: str, block: int) -> str:
        self.denials[reason] = self.denials.get(reason, 0) + 1
        self._event("denied", block=block, reason=reason)
        return reason

    def _event(self, kind: str, **fields) -> None:
        if self.events is not None:
            self.events.append({"event": kind, "phase": self.phase, **fields})

    # ---- telemetry ------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        b = self.budget
        return {"hints": self.hints.as_dict(), "conductor_denials": dict(self.denials),
                "budget": {"reserved_mb": round(b.reserved / 2**20, 1), "pressure": round(self._pressure(), 4),
                           "grant_count": b.grants, "deny_count": b.denials, "partial_count": b.partials},
                "h2d_inflight": self.transfers.inflight_count(Direction.H2D),
                "d2h_inflight": self.transfers.inflight_count(Direction.D2H)}
