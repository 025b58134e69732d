"""Calibration before training: each block's output error ||out_bf16 - out_candidate|| / ||out_bf16|| in its
candidate precision, from a hook that re-runs the block on its real inputs, averaged over the batches; cached as
JSON under a fingerprint of the model, the quant config, the batches and the block layout."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from torch_stagehand.environment import cache_dir as stagehand_cache_dir
from torch_stagehand.runtime.atomic_file import write_atomic
from torch_stagehand.runtime.precision import FULL

log = logging.getLogger("torch_stagehand.selective_precision")
_SAMPLED_BYTES = 1 << 16  # per block buffer: enough to tell weights apart, cheap on a 12B model


@dataclass
class CalibrationResult:
    errors: dict[int, float]
    fingerprint: str
    path: str
    from_cache: bool
    candidates: dict[int, str] = field(default_factory=dict)


def _tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    step = max(1, t.numel() // _SAMPLED_BYTES)
    return hashlib.sha256(t[::step].numpy().tobytes() + str(t.numel()).encode()).hexdigest()[:16]


def _batch_digest(batch) -> list:
    items = batch.items() if isinstance(batch, dict) else enumerate(batch if isinstance(batch, (list, tuple)) else [batch])
    return [(str(k), _tensor_digest(v) if isinstance(v, torch.Tensor) else repr(v)) for k, v in items]


def fingerprint(model: nn.Module, store, quantizer: str, blocks: list[str], batches: list,
                candidates: dict[int, str]) -> str:
    config = getattr(model, "config", None)
    identity = {
        "class": type(model).__qualname__,
        "config": config.to_json_string() if hasattr(config, "to_json_string") else None,
        "weights": [_tensor_digest(bb.full) if bb.full is not None else None for bb in store.blocks],
    }
    quant = {"candidates": {str(b): p for b, p in sorted(candidates.items())}, "quantizer": quantizer,
             "samples": len(batches), "batches": [_batch_digest(b) for b in batches]}
    layout = {"blocks": list(blocks),
              "layers": [[lay.as_ints() for lay in store.layout(b, p)] for b, p in sorted(candidates.items())]}
    text = json.dumps({"identity": identity, "quant": quant, "layout": layout}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def calibrate(model: nn.Module, batches: list, low_for: Callable[[int], str], cache_dir: str | None = None, *,
              offloaded: nn.Module, store, quantizer: str, blocks: list[str], precision: Callable[[], dict[int, str]],
              set_precision: Callable[[dict[int, str]], None]) -> CalibrationResult:
    if not batches:
        raise ValueError("selective precision: calibrate() needs at least one batch")
    candidates = {b: low_for(b) for b in range(len(blocks))}
    key = fingerprint(offloaded, store, quantizer, blocks, batches, candidates)
    path = os.path.join(cache_dir or os.path.join(stagehand_cache_dir(), "calibration"), f"calibration-{key}.json")
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        errors = {int(b): float(e) for b, e in data["errors"].items()}
        log.info("selective precision: calibration read from %s", path)
        return CalibrationResult(errors, key, path, True, candidates)
    errors = _measure(model, batches, candidates, blocks, precision, set_precision)
    # Another process calibrating the same model writes the same numbers.
    write_atomic(path, json.dumps({"fingerprint": key, "candidates": {str(b): p for b, p in candidates.items()},
                                   "errors": {str(b): e for b, e in errors.items()}}, indent=1))
    log.info("selective precision: calibrated %d blocks, written to %s", len(errors), path)
    return CalibrationResult(errors, key, path, False, candidates)


def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"selective precision: calibration cannot read a block output of type {type(out).__name__}")


def _measure(model: nn.Module, batches: list, candidates: dict[int, str], blocks: list[str], precision,
             set_precision) -> dict[int, float]:
    """Run the batches; each block's hook re-runs it in its candidate precision on the same input."""
    sums = {b: 0.0 for b in candidates}
    counts = {b: 0 for b in candidates}
    start = dict(precision())
    full = {b: FULL for b in start}
    busy = [False]

    def hook_for(block: int):
        def hook(module, args, kwargs, output):
            if busy[0]:
                return None
            busy[0] = True
            try:
                set_precision({block: candidates[block]})
                candidate_out = _first_tensor(module(*args, **kwargs)).double()
            finally:
                set_precision({block: FULL})
                busy[0] = False
            reference = _first_tensor(output).double()
            sums[block] += ((candidate_out - reference).norm() / reference.norm().clamp_min(1e-30)).item()
            counts[block] += 1
            return None
        return hook

    handles = [model.get_submodule(fqn).register_forward_hook(hook_for(b), with_kwargs=True)
               for b, fqn in enumerate(blocks)]
    set_precision(full)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager op path is the point here, not a fallback
            for batch in batches:
                model(**batch) if isinstance(batch, dict) else model(*batch)
    finally:
        for h in handles:
            h.remove()
        set_precision(start)
    missing = [blocks[b] for b, n in counts.items() if n == 0]
    if missing:
        raise RuntimeError(f"selective precision: calibration never ran block {missing[0]} (is the model the "
                           "offloaded one, called without torch.compile?)")
    return {b: sums[b] / counts[b] for b in candidates}
