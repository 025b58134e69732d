"""The policy bridge: the seed's three rules turned into limit hints, monotonic within a step.

Rule 1, backward pressure: in BACKWARD with VRAM pressure above the threshold
(0.8), speculative prefetch stops and the prefetch window drops to 1.
Rule 2, optimizer protection: in OPTIMIZER, speculative work stops and H2D is
limited to one copy in flight.
Rule 3, contention: when the transfer pool was found full on more than
`contention_checks` consecutive checks, the window shrinks by one (down to 1)
each time it is seen again.

Within a step hints only tighten: the window and the in-flight caps never
grow, suppression never lifts. `reset()` at STEP_BEGIN returns the plan's
values. `shrink(reason)` is how anything else (an allocation failure during a
prefetch) tightens the window, with its reason kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

BACKWARD, OPTIMIZER = "backward", "optimizer"


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
        return {"max_inflight_h2d": self.max_inflight_h2d, "max_inflight_d2h": self.max_inflight_d2h,
                "prefetch_window_cap": self.prefetch_window_cap, "suppress_speculative": self.suppress_speculative,
                "reasons": list(self.reasons)}


class HeuristicPolicyBridgeV0:
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
        h = self.hints
        candidate = h
        if phase == BACKWARD and pressure > self.pressure_threshold:
            candidate = candidate.tighten(replace(h, prefetch_window_cap=1, suppress_speculative=True,
                                                  reasons=("backward_pressure",)))
        if phase == OPTIMIZER:
            candidate = candidate.tighten(replace(h, max_inflight_h2d=1, suppress_speculative=True,
                                                  reasons=("optimizer_phase",)))
        if contention > self.contention_checks:
            candidate = candidate.tighten(replace(h, prefetch_window_cap=max(1, h.prefetch_window_cap - 1),
                                                  reasons=("contention",)))
        self.hints = h.tighten(candidate)
        return self.hints

    def shrink(self, reason: str) -> RuntimeLimitHints:
        h = self.hints
        self.hints = h.tighten(replace(h, prefetch_window_cap=max(1, h.prefetch_window_cap - 1), reasons=(reason,)))
        return self.hints
