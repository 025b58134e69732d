"""Selective precision acting on a Runtime (`rt.selective`, made by `offload(precision="auto")` or a set
`selective_precision.mode`). `rt.attach(optimizer)` registers its pre-step hook: after each backward it queues the
per-block gradient reductions on the device; every `update_interval_steps` (after `warmup_steps`) it reads the window
once, scores the blocks, applies the new map through the `set_precision` it was given, logs each change and writes a
telemetry record. `rt.observe_loss(loss)` (optional) feeds the loss-spike revert."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

from torch_stagehand.runtime.precision import FP8, FULL, INT8
from torch_stagehand.runtime.selective import fp8_rules
from torch_stagehand.runtime.selective.calibration import CalibrationResult, calibrate
from torch_stagehand.runtime.selective.grad_stats import BlockGradStats, WindowStats
from torch_stagehand.runtime.selective.policy import Change, SelectivePolicy, check_force_lists
from torch_stagehand.runtime.selective.telemetry import PrecisionTelemetry
from torch_stagehand.runtime.selective.units import Units

log = logging.getLogger("torch_stagehand.selective_precision")
AUTO = "auto"  # offload(precision="auto"): the policy picks the map


def selective_precision_requested(cfg, auto: bool) -> bool:
    """The policy acts when asked: precision="auto", or a selective_precision section that sets a mode."""
    return cfg.enabled and (auto or cfg.mode is not None)


class SelectivePrecision:
    def __init__(self, start: Mapping[int, str], start_given: bool, *, config, model, device: torch.device,
                 blocks: list[str], layers, store, pool, precision: Callable[[], dict[int, str]],
                 set_precision: Callable[[dict[int, str]], None]):
        """start: the starting map; start_given: the user chose it (precision= a map or a name with a
        mode set), so the ambiguous zone keeps it; else ("auto") `ambiguous_default` places those blocks.
        `precision()`: the runtime's map now (read); `set_precision(map)` applies a map to the runtime."""
        self.cfg = cfg = config.selective_precision
        self.quantizer, self.model, self.device, self.blocks = config.quantizer, model, device, blocks
        self.store, self.pool, self.precision, self.set_precision = store, pool, precision, set_precision
        self.fp8 = None
        force = check_force_lists(cfg, len(blocks))
        self.units = units = Units(len(blocks), cfg.granularity == "layer")
        self._fp8_units: set[int] = set()  # units whose every layer the FP8 policy file measured faster
        if cfg.fp8_policy_file is not None:
            device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
            self.fp8 = fp8_rules.load(cfg.fp8_policy_file, device_name)
            self._fp8_units = {u for u in range(len(units)) if self.fp8.block_takes_fp8(
                [(s.out_features, s.in_features) for s in units.layers_of(u, layers)], cfg.fp8_tokens)}
        slab_only = {b: INT8 for b in range(len(blocks)) if not store.can_stream(b, FULL)}
        self.policy = SelectivePolicy(cfg, len(units), low_for=self.low_for_unit,
                                      pinned=units.of_blocks(slab_only), force=units.of_blocks(force),
                                      start_given=start_given)
        self.telemetry = PrecisionTelemetry(cfg.telemetry_file if cfg.telemetry_enabled else None)
        self.stats: BlockGradStats | None = None
        self.errors: dict[int, float] | None = None  # calibration (None: gradients alone)
        self.calibration: CalibrationResult | None = None
        self.step = 0  # backward passes collected (optimizer steps)
        self.changes: list[Change] = []
        self.map_history: list[tuple[int, dict[int, str]]] = []  # (step, map) after each update
        self._losses: list[tuple[int, torch.Tensor]] = []  # (step, device loss) not read yet
        self.loss_history: list[tuple[int, float]] = []
        self._watched: list[Change] = []  # switches to fewer bytes the loss feedback still watches
        self._h2d_at_update = pool.stats.h2d_bytes
        self._step_at_update = 0
        self._baseline_per_step: float | None = None
        start = units.unit_map(start)
        initial = self.policy.initial_map(start)
        self._apply(initial, [Change(u, start[u], p, 0, None, "mode off" if self.policy.mode == "off" else "force")
                              for u, p in initial.items() if p != start[u]])
        self.map_history.append((0, dict(precision())))

    def attach(self, optimizer: torch.optim.Optimizer) -> list[Any]:
        # Bytes moved before training (calibration, a first eager call) are no step's.
        self._h2d_at_update, self._step_at_update = self.pool.stats.h2d_bytes, self.step
        return [optimizer.register_step_pre_hook(lambda *_: self.after_backward())]

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Remember this step's loss for the spike check (kept on the device; read once per update)."""
        self._losses.append((self.step + 1, loss.detach().float().reshape(())))

    def calibrate(self, batches, model=None) -> CalibrationResult | None:
        """Per-block output error of each block's low precision on `batches` (cached on disk)."""
        if not self.cfg.run_calibration:
            log.info("selective precision: run_calibration is false; the policy scores gradients alone")
            return None
        batches = list(batches)[: self.cfg.calibration_samples]
        self.calibration = calibrate(model or self.model, batches, self.low_for, self.cfg.calibration_cache_dir,
                                     offloaded=self.model, store=self.store, quantizer=self.quantizer,
                                     blocks=self.blocks, precision=self.precision, set_precision=self.set_precision)
        self.errors = dict(self.calibration.errors)
        return self.calibration

    def low_for_unit(self, unit: int) -> str:
        """Where the policy sends a unit for fewer bytes: fp8 where measured faster than bf16, else int8."""
        return FP8 if unit in self._fp8_units else INT8

    def low_for(self, block: int) -> str:
        """The block's precision with every unit of it sent down: what calibration measures."""
        units = self.units
        down = {u: self.low_for_unit(u) if units.block(u) == block else FULL for u in range(len(units))}
        return units.block_map(down)[block]

    def summary(self) -> dict[str, Any]:
        return {"mode": self.policy.mode, "steps": self.step, "switches": len(self.changes),
                "grad_stat_reads": 0 if self.stats is None else self.stats.host_reads,
                "calibrated_blocks": 0 if self.errors is None else len(self.errors),
                "fp8_blocks": sorted({self.units.block(u) for u in self._fp8_units}),
                "fp8_units": [self.units.label(u) for u in sorted(self._fp8_units)]}

    def close(self) -> None:
        self.telemetry.close()

    def after_backward(self) -> None:
        if self.policy.mode != "dynamic":
            return
        if self.stats is None:  # built on the first step: adapters may be added between offload and training
            self.stats = BlockGradStats(self.units.params(self.model, self.blocks), self.cfg.history_window,
                                        self.device)
        self.stats.collect()
        self.step += 1
        if self.policy.due(self.step):
            self._update()

    def _update(self) -> None:
        window = self.stats.read()
        current = self.units.unit_map(self.precision())
        errors = None if self.errors is None else {u: self.errors[self.units.block(u)] for u in range(len(self.units))}
        new, changes = self.policy.update(self.step, current, window.rel_magnitude, errors)
        reverts = self._loss_feedback(new)
        new.update({r.block: FULL for r in reverts})
        changes = [c for c in changes if c.block not in {r.block for r in reverts}] + reverts
        self._apply(new, changes)
        self._watched += [c for c in changes if c.new != FULL and c.old == FULL]
        self.map_history.append((self.step, dict(self.precision())))
        self._write_telemetry(window, changes)

    def _apply(self, new: dict[int, str], changes: list[Change]) -> None:
        """Apply a unit map; `changes` are per unit (a block, or a block's attention / MLP)."""
        if changes:
            self.set_precision(self.units.block_map(new))
        for c in changes:
            self.changes.append(c)
            if self.cfg.log_decisions:
                score = "" if c.sensitivity is None else f", sensitivity {c.sensitivity:.3f}"
                log.info("selective precision: step %d: block %s (%s) %s -> %s (%s%s)", c.step, self.units.label(c.block),
                         self.blocks[self.units.block(c.block)], c.old, c.new, c.reason, score)

    def _loss_feedback(self, new: dict[int, str]) -> list[Change]:
        if self._losses:
            values = torch.stack([v for _, v in self._losses]).cpu().tolist()  # one read per update
            self.loss_history += [(s, v) for (s, _), v in zip(self._losses, values)]
            self._losses.clear()
        span = self.cfg.loss_feedback_steps
        reverts, still = [], []
        for c in self._watched:
            before = [v for s, v in self.loss_history if c.step - span < s <= c.step]
            after = [v for s, v in self.loss_history if c.step < s <= c.step + span]
            if before and after and _mean(after) > _mean(before) * (1 + self.cfg.loss_spike_ratio):
                if new[c.block] != FULL:
                    reverts.append(self.policy.revert(c.block, self.step, new[c.block]))
            elif self.step - c.step < span:
                still.append(c)
        self._watched = still
        return reverts

    def _write_telemetry(self, window: WindowStats, changes: list[Change]) -> None:
        pmap, nbytes = self.precision(), self.store.nbytes
        h2d = self.pool.stats.h2d_bytes
        per_step = (h2d - self._h2d_at_update) / max(self.step - self._step_at_update, 1)
        all_full = sum(nbytes(b, FULL) for b in range(len(self.blocks)))
        if self._baseline_per_step is None and per_step > 0:
            # The first interval's bytes per step (it ran the last map but one), scaled to what all-bf16 would move.
            ran = sum(nbytes(b, p) for b, p in self.map_history[-2][1].items())
            self._baseline_per_step = per_step * all_full / ran
        measured = None if not self._baseline_per_step else round(100 * (1 - per_step / self._baseline_per_step), 2)
        units = self.units
        scores = [self.policy.last_scores.get(u, 0.0) for u in range(len(units))]
        self.telemetry.write({
            "step_id": self.step,
            "blocks_bf16": sum(p == FULL for p in pmap.values()),
            "blocks_int8": sum(p == INT8 for p in pmap.values()),
            "blocks_fp8": sum(p == FP8 for p in pmap.values()),
            "blocks_mixed": sum(p not in (FULL, INT8, FP8) for p in pmap.values()),  # per layer: by-role
            "mean_sensitivity": round(sum(scores) / len(scores), 4),
            "max_sensitivity": round(max(scores), 4),
            "min_sensitivity": round(min(scores), 4),
            "precision_changes": len(changes),
            "estimated_bandwidth_saving_pct": round(
                100 * (1 - sum(nbytes(b, p) for b, p in pmap.items()) / all_full), 2),
            "measured_bandwidth_saving_pct": measured,
            "measured_over_map_of_step": self.map_history[-2][0],  # the map the measured interval ran
            "h2d_bytes_per_step": round(per_step),
            "baseline_h2d_bytes_per_step": None if self._baseline_per_step is None else round(self._baseline_per_step),
            "block_details": {units.label(u): {
                "precision": pmap[units.block(u)], "sensitivity": round(scores[u], 4), "grad_l2": window.l2[u],
                "grad_max_abs": window.max_abs[u], "grad_variance": window.variance[u],
                "rel_magnitude": round(window.rel_magnitude[u], 4),
                "quant_error": None if self.errors is None else self.errors.get(units.block(u))}
                for u in range(len(units))},
        })
        self._h2d_at_update, self._step_at_update = h2d, self.step


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)

