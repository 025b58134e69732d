"""The selective-precision decision engine: sensitivity scores in, a precision map out. Pure (no torch).

sensitivity = grad_weight * grad_score + error_weight * error_score, where
grad_score = min(relative gradient magnitude / grad_sensitivity_threshold, 1) and
error_score = min(calibration error / quant_error_threshold, 1); without calibration
the gradient score alone (selective-precision.txt: "relies on gradient statistics alone").

Decisions (dynamic mode): a block the policy has not decided yet takes bf16 at or above
bf16_threshold, the low precision below int8_threshold, and in between ("the ambiguous
zone where blocks keep their current assignment") the starting map's precision when the
user gave one, else (`precision="auto"`) `ambiguous_default`.
After that a bf16 block goes down only below int8_threshold - hysteresis_margin, a
low-precision block comes back only at or above bf16_threshold, anything else keeps its
precision, and no block changes within min_steps_between_switches of its last change.
force_bf16_blocks / force_int8_blocks win in every mode; "off" is all bf16 (but the
force lists), "static" is the starting map with the force lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

FULL = "bf16"
INT8 = "int8"


@dataclass(frozen=True)
class Change:
    block: int
    old: str
    new: str
    step: int
    sensitivity: float | None
    reason: str  # "score", "force", "mode off", "loss spike"


def check_force_lists(cfg, n_blocks: int) -> None:
    bad = [b for b in (*cfg.force_bf16_blocks, *cfg.force_int8_blocks) if b >= n_blocks]
    if bad:
        # A config that does not fit the model (a ValueError still; the CLI reports ConfigError in one line).
        # Imported here: the engine itself stays free of torch.
        from torch_stagehand.runtime.config import ConfigError

        raise ConfigError(f"selective_precision.force_*_blocks: block {bad[0]} does not exist "
                         f"(the model has blocks 0..{n_blocks - 1})")


class SelectivePolicy:
    def __init__(self, cfg, n_blocks: int, low_for: Callable[[int], str] | None = None,
                 pinned: Mapping[int, str] | None = None, force: Mapping[int, str] | None = None,
                 start_given: bool = False):
        """cfg: a PrecisionConfig (validated). low_for(block): the precision a block takes when the
        policy sends it to fewer bytes ("int8", or "fp8" where measured faster). pinned: blocks that
        can stream one precision only (loaded from an INT8 slab alone), treated like a force list.
        force: {unit: precision} instead of cfg's force lists (the controller's per-layer units).
        start_given: the starting map is the user's, kept in the ambiguous zone (else ambiguous_default)."""
        self.cfg = cfg
        self.pinned = dict(pinned or {})
        self.n_blocks = n_blocks  # decision units: blocks, or (granularity "layer") a block's attention / MLP
        if force is None:
            check_force_lists(cfg, n_blocks)
            force = {b: FULL for b in cfg.force_bf16_blocks} | {b: INT8 for b in cfg.force_int8_blocks}
        self.force = dict(force)
        self.low_for = low_for or (lambda block: INT8)
        self.mode = cfg.effective_mode
        self.last_switch: dict[int, int] = {}  # block -> step of its last policy change
        self.decided: set[int] = set()  # blocks the scores have placed at least once
        self.start_given = start_given
        self.blocked_until: dict[int, int] = {}  # loss feedback: block -> step before which it stays bf16
        self.last_scores: dict[int, float] = {}

    # ---- maps ------------------------------------------------------------------------

    def forced(self, block: int) -> str | None:
        return self.pinned.get(block) or self.force.get(block)

    def initial_map(self, start: Mapping[int, str]) -> dict[int, str]:
        """The map in force from offload on: the starting map, all bf16 in mode off; force lists on top."""
        out = {b: (FULL if self.mode == "off" else start[b]) for b in range(self.n_blocks)}
        for b in range(self.n_blocks):
            out[b] = self.forced(b) or out[b]
        return out

    def due(self, step: int) -> bool:
        """Is `step` (1-based count of collected backward passes) an update step?"""
        cfg = self.cfg
        return self.mode == "dynamic" and step >= cfg.warmup_steps and step % cfg.update_interval_steps == 0

    # ---- scores ----------------------------------------------------------------------

    def sensitivity(self, rel_magnitude: float, error: float | None) -> float:
        cfg = self.cfg
        grad_score = min(rel_magnitude / cfg.grad_sensitivity_threshold, 1.0)
        if error is None:
            return max(0.0, grad_score)
        error_score = min(error / cfg.quant_error_threshold, 1.0)
        return min(1.0, max(0.0, cfg.grad_weight * grad_score + cfg.error_weight * error_score))

    def update(self, step: int, current: Mapping[int, str], rel_magnitude: Sequence[float],
               errors: Mapping[int, float] | None = None) -> tuple[dict[int, str], list[Change]]:
        """One dynamic update: the new map and the changes it makes (empty outside dynamic mode)."""
        new = dict(current)
        changes: list[Change] = []
        if self.mode != "dynamic":
            return new, changes
        errors = errors or {}
        for b in range(self.n_blocks):
            score = self.sensitivity(rel_magnitude[b], errors.get(b))
            self.last_scores[b] = score
            target = self.forced(b) or self._target(b, current[b], score, step)
            if target != current[b]:
                new[b] = target
                self.last_switch[b] = step
                changes.append(Change(b, current[b], target, step, score, "force" if self.forced(b) else "score"))
            self.decided.add(b)
        return new, changes

    def _target(self, block: int, current: str, score: float, step: int) -> str:
        cfg = self.cfg
        low = self.low_for(block)
        if self.blocked_until.get(block, -1) > step:
            return FULL if self._may_switch(block, step) or current == FULL else current
        if not self._may_switch(block, step):
            return current
        if block not in self.decided:
            if score >= cfg.bf16_threshold:
                return FULL
            if score < cfg.int8_threshold:
                return low
            if self.start_given:
                return current
            return low if cfg.ambiguous_default != FULL else FULL
        if current == FULL:
            return low if score < cfg.int8_threshold - cfg.hysteresis_margin else FULL
        return FULL if score >= cfg.bf16_threshold else current

    def _may_switch(self, block: int, step: int) -> bool:
        last = self.last_switch.get(block)
        return last is None or step - last >= self.cfg.min_steps_between_switches

    # ---- loss feedback ---------------------------------------------------------------

    def revert(self, block: int, step: int, current: str) -> Change:
        """A loss spike followed this block's switch to fewer bytes: back to bf16, kept there longer."""
        self.blocked_until[block] = step + self.cfg.loss_feedback_block_steps
        self.last_switch[block] = step
        return Change(block, current, FULL, step, self.last_scores.get(block), "loss spike")
