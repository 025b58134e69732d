"""The measured FP8 policy file (made per device by `python -m torch_stagehand.runtime.selective.fp8_bench`):

    {"version": 1, "device": "NVIDIA H100 80GB HBM3", "speedup_threshold": 1.0,
     "rules": [{"out_features": 3072, "in_features": 3072, "min_tokens": 4096, "measured_speedup": 1.21}, ...]}

A layer [out, in] takes fp8 at `tokens` tokens when a rule for its shape has min_tokens <= tokens (no rule: bf16 is
not slower, keep it); a block takes fp8 only when every one of its layers does."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable

from torch_stagehand.runtime.atomic_file import write_atomic

VERSION = 1


class Fp8PolicyError(ValueError):
    """The FP8 policy file is missing, malformed or made on another device; the message names the file."""


@dataclass(frozen=True)
class Fp8Rule:
    out_features: int
    in_features: int
    min_tokens: int
    measured_speedup: float


@dataclass
class Fp8Policy:
    device: str
    speedup_threshold: float
    rules: list[Fp8Rule]

    def layer_takes_fp8(self, out_features: int, in_features: int, tokens: int) -> bool:
        return any(r.out_features == out_features and r.in_features == in_features and r.min_tokens <= tokens
                   and r.measured_speedup > self.speedup_threshold for r in self.rules)

    def block_takes_fp8(self, shapes: Iterable[tuple[int, int]], tokens: int) -> bool:
        shapes = list(shapes)
        return bool(shapes) and all(self.layer_takes_fp8(n, k, tokens) for n, k in shapes)


def rules_from_measurements(rows: list[dict], speedup_threshold: float = 1.0) -> list[Fp8Rule]:
    """Per shape of `rows`, the smallest token count from which every measured speedup is above the threshold."""
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for row in rows:
        by_shape.setdefault((row["out_features"], row["in_features"]), []).append(row)
    rules = []
    for (n, k), shape_rows in sorted(by_shape.items()):
        shape_rows.sort(key=lambda r: r["tokens"])
        start = next((i for i in range(len(shape_rows))
                      if all(r["speedup"] > speedup_threshold for r in shape_rows[i:])), None)
        if start is not None:
            worst = min(r["speedup"] for r in shape_rows[start:])
            rules.append(Fp8Rule(n, k, shape_rows[start]["tokens"], round(worst, 4)))
    return rules


def load(path: str, device_name: str | None = None) -> Fp8Policy:
    if not os.path.exists(path):
        raise Fp8PolicyError(f"{path}: no FP8 policy file (make one on this GPU: "
                             "python -m torch_stagehand.runtime.selective.fp8_bench --out PATH)")
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != VERSION:
            raise Fp8PolicyError(f"{path}: FP8 policy version {data.get('version')!r}, expected {VERSION}")
        rules = [Fp8Rule(int(r["out_features"]), int(r["in_features"]), int(r["min_tokens"]),
                         float(r["measured_speedup"])) for r in data["rules"]]
        policy = Fp8Policy(str(data["device"]), float(data["speedup_threshold"]), rules)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, Fp8PolicyError):
            raise
        raise Fp8PolicyError(f"{path}: not an FP8 policy file ({type(e).__name__}: {e})") from None
    if device_name is not None and policy.device != device_name:
        raise Fp8PolicyError(f"{path}: measured on {policy.device!r}, this device is {device_name!r}; "
                             "timings do not carry over: measure again on this GPU")
    return policy


def save(policy: Fp8Policy, path: str) -> None:
    data = {"version": VERSION, "device": policy.device, "speedup_threshold": policy.speedup_threshold,
            "rules": [vars(r) for r in policy.rules]}
    write_atomic(os.path.abspath(path), json.dumps(data, indent=1))  # never a torn rules file
