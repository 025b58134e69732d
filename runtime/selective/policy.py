"""The selective-precision decision engine: sensitivity scores in, a precision map out. Pure (no torch).

sensitivity = grad_weight * min(rel. gradient magnitude / grad_sensitivity_threshold, 1) + error_weight *
min(calibration error / quant_error_threshold, 1), or the gradient score alone. Dynamic mode: an undecided block
takes bf16 at or above bf16_threshold, the low precision below int8_threshold, else its starting precision (the
user's) or `ambiguous_default`; then a bf16 block goes down only below int8_threshold - hysteresis_margin, a low
one comes back at bf16_threshold, never within min_steps_between_switches. Force lists win in every mode;
"off" is all bf16, "static" the starting map."""

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


def check_force_lists(cfg, n_blocks: int) -> dict[int, str]:
    """cfg's force lists checked against the model's blocks, as {block: precision}."""
    bad = [b for b in (*cfg.force_bf16_blocks, *cfg.force_int8_blocks) if b >= n_blocks]
    if bad:
        # A config that does not fit the model (the CLI reports ConfigError in one line); imported here: no torch.
        from torch_stagehand.runtime.config import ConfigError

        raise ConfigError(f"selective_precision.force_*_blocks: block {bad[0]} does not exist "
                         f"(the model has blocks 0..{n_blocks - 1})")
    return {b: FULL for b in cfg.force_bf16_blocks} | {b: INT8 for b in cfg.force_int8_blocks}


class SelectivePolicy:
    def __init__(self, cfg, n_blocks: int, low_for: Callable[[int], str] | None = None,
                 pinned: Mapping[int, str] | None = None, force: Mapping[int, str] | None = None,
                 start_given: bool = False):
        """cfg: a validated PrecisionConfig. low_for(block): where the policy sends a block for fewer bytes. pinned:
        blocks that stream one precision only (a slab alone), like a force list. force: {unit: precision} instead
        of cfg's force lists. start_given: the starting map is the user's, kept in the ambiguous zone."""
        self.cfg = cfg
        self.pinned = dict(pinned or {})
        self.n_blocks = n_blocks  # decision units: blocks, or (granularity "layer") a block's attention / MLP
        self.force = check_force_lists(cfg, n_blocks) if force is None else dict(force)
        self.low_for = low_for or (lambda block: INT8)
        self.mode = cfg.effective_mode
        self.last_switch: dict[int, int] = {}  # block -> step of its last policy change
        self.decided: set[int] = set()  # blocks the scores have placed at least once
        self.start_given = start_given
        self.blocked_until: dict[int, int] = {}  # loss feedback: block -> step before which it stays bf16
        self.last_scores: dict[int, float] = {}

    def forced(self, block: int) -> str | None:
        return self.pinned.get(block) or self.force.get(block)

    def initial_map(self, start: Mapping[int, str]) -> dict[int, str]:
        """The map in force from offload on: the starting map, all bf16 in mode off; force lists on top."""
        return {b: self.forced(b) or (FULL if self.mode == "off" else start[b]) for b in range(self.n_blocks)}

    def due(self, step: int) -> bool:
        """Is `step` (1-based count of collected backward passes) an update step?"""
        cfg = self.cfg
        return self.mode == "dynamic" and step >= cfg.warmup_steps and step % cfg.update_interval_steps == 0

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

    def revert(self, block: int, step: int, current: str) -> Change:
        """A loss spike followed this block's switch to fewer bytes: back to bf16, kept there longer."""
        self.blocked_until[block] = step + self.cfg.loss_feedback_block_steps
        self.last_switch[block] = step
        return Change(block, current, FULL, step, self.last_scores.get(block), "loss spike")
