"""The planner's inputs: byte sizes, the budget, and a cost model from measurements.

`BlockCost` is one block as the planner sees it; `CostModel` adds the machine (H2D / D2H bandwidth, measured once
per device and cached on disk) and the bytes that are no block's, calibrated from a measured step. On the CPU the
budget bounds the streamed weights' device copy alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass, field, replace

import torch

from torch_stagehand.runtime.atomic_file import write_atomic
from torch_stagehand.runtime.host.budget import gib
from torch_stagehand.environment import cache_dir

# Compute time assumed for a block before one was measured: only its ratio to the transfer time matters.
DEFAULT_BLOCK_SECONDS = 1e-3
# Host-to-device bandwidth assumed where nothing can be measured (the CPU "device").
DEFAULT_H2D_BPS = 20e9
# Where a cost model's block times come from (`CostModel.source`).
DEFAULT, MEASURED, GIVEN = "default", "measured", "given"


class BudgetError(ValueError):
    """A VRAM budget that cannot be read, or that no plan fits under."""


_UNITS = {"b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_UNIT_HINT = "a size with a unit: '20GiB', '512MiB' (GiB = 2**30 bytes) or '20GB', '512MB' (GB = 10**9 bytes)"
# The fewest bytes a budget given as a number may be: fewer is a unit mistake (20 meant as GiB, 512 as MB).
# Not 1 MiB: on the CPU toy models are planned in KiB (the budget bounds the streamed weights alone).
MIN_BUDGET_BYTES = 4 * 2**10


def parse_bytes(value: int | float | str, what: str = "vram_budget") -> int:
    """Bytes from a number of bytes (at least MIN_BUDGET_BYTES) or a string with a unit ("20GiB", "512MB")."""
    if isinstance(value, bool):
        raise BudgetError(f"{what}: expected bytes or {_UNIT_HINT}, got {value!r}")
    if isinstance(value, str):
        return _parse_size(value, what)
    if not isinstance(value, (int, float)):
        raise BudgetError(f"{what}: expected bytes or {_UNIT_HINT}, got {type(value).__name__}")
    if value <= 0:
        raise BudgetError(f"{what}: must be positive, got {value!r}")
    if value < MIN_BUDGET_BYTES:
        raise BudgetError(f"{what}: {value!r} is {value!r} bytes (a number is read as bytes), fewer than "
                          f"{MIN_BUDGET_BYTES} and too few to be meant; write {_UNIT_HINT}")
    return int(value)


def _parse_size(text: str, what: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is not None and not m.group(2):
        raise BudgetError(f"{what}: {text!r} has no unit; write {_UNIT_HINT}")
    if m is None or m.group(2).lower() not in _UNITS:
        raise BudgetError(f"{what}: cannot read {text!r}; write {_UNIT_HINT}")
    number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if number <= 0:
        raise BudgetError(f"{what}: must be positive, got {text!r}")
    return int(number)


@dataclass(frozen=True)
class Budget:
    """Device bytes the plan may use: the soft cap is planned for, the hard cap never crossed."""

    soft: int | None = None
    hard: int | None = None

    @property
    def limit(self) -> int | None:
        """The bound a plan must predict under (soft if set, else hard)."""
        return self.soft if self.soft is not None else self.hard

    def describe(self) -> str:
        parts = [f"{name} {human(v)}" for name, v in (("soft", self.soft), ("hard", self.hard)) if v]
        return ", ".join(parts) or "no cap"


def human(nbytes: float) -> str:
    """Bytes as GiB / MiB / KiB, whichever reads best, or B."""
    return gib(nbytes) if abs(nbytes) >= 2**10 else f"{int(nbytes)} B"


@dataclass(frozen=True)
class BlockCost:
    """One block for the planner (times in seconds, sizes in bytes)."""

    bytes: int  # streamed weight bytes in the precision the block runs in
    forward_s: float = DEFAULT_BLOCK_SECONDS
    backward_s: float = 2 * DEFAULT_BLOCK_SECONDS  # the backward alone (a recompute adds forward_s)
    activation_bytes: int = 0  # saved for backward when the activations are kept
    input_bytes: int = 0  # saved instead when the block recomputes (its inputs)
    # The host's time to issue the block's forward, its recompute, its backward (and the glue up to the
    # next block): the GPU cannot finish a block before the host has issued it. 0: not measured.
    host_forward_s: float = 0.0
    host_recompute_s: float = 0.0
    host_backward_s: float = 0.0
    host_fetch_share: float = 0.0  # of those, the share spent in schedule ops: what a resident block skips
    # Full fine-tuning: weight-gradient bytes sent D2H after its backward, and the host optimizer's step of the block
    # once they landed (0 when the optimizer runs after the backward). A block updated on the device sends its
    # states and weights home instead (`grad_bytes`), fetches `update_in_bytes` of states and has no `optimizer_s`.
    grad_bytes: int = 0
    optimizer_s: float = 0.0
    update_in_bytes: int = 0


@dataclass
class CostModel:
    """The machine and the model as measured (or injected for tests: `frozen` stops calibration)."""

    h2d_bps: float = DEFAULT_H2D_BPS
    d2h_bps: float | None = None
    forward_s: list[float] | None = None  # per block, measured in the first steps
    backward_s: list[float] | None = None
    activation_bytes: list[int] | None = None
    input_bytes: list[int] | None = None
    host_s: dict[str, list[float]] | None = None  # "forward" / "recompute" / "backward" -> per block (host issue)
    host_fetch_share: list[float] | None = None  # per block: the share of its host time in schedule ops
    grad_bytes: list[int] | None = None  # per block: weight-gradient bytes landed on the host (full fine-tuning)
    optimizer_s: list[float] | None = None  # per block: the host optimizer's step, measured (HostAdamW)
    update_in_bytes: list[int] | None = None  # per block: states fetched for an update on the device
    base_bytes: int = 0  # device bytes that are no block's streamed weights or saved activations, at the peak
    spill_room_bytes: int | None = None  # host memory spilled activations may take (None: not bounded)
    other_s: float = 0.0  # step time outside the blocks (glue, loss, optimizer), added to every plan
    frozen: bool = False  # injected constants: the runtime does not overwrite them with measurements
    measured: dict = field(default_factory=dict)  # where the numbers came from (printed with the plan)

    @property
    def source(self) -> str:
        """What a prediction rests on. MEASURED: a calibration step measured the block times (or kept them); GIVEN:
        a caller set them (tests, `rt.replan(cost_model=...)`); DEFAULT: no block time is known."""
        if "calibration_step_s" in self.measured:
            return MEASURED
        if self.forward_s is None and self.backward_s is None and self.host_s is None:
            return DEFAULT
        return GIVEN

    def learn_link(self, device: torch.device, pinned: bool, node=None) -> None:
        """The host link's bandwidth both ways: the shared node store's (host/node_store.py), else this device's."""
        if node is not None and node.link_bps:
            self.h2d_bps, self.d2h_bps = node.link_bps["h2d"], node.link_bps["d2h"]
            self.measured["h2d"] = self.measured["d2h"] = node.link_source
            return
        self.h2d_bps, self.measured["h2d"] = h2d_bandwidth(device, pinned=pinned)
        if torch.device(device).type == "cuda":  # spill needs the other direction (never chosen without it)
            self.d2h_bps, self.measured["d2h"] = h2d_bandwidth(device, pinned, direction="d2h")

    def block_costs(self, nbytes: list[int]) -> list[BlockCost]:
        def pick(values, b, default):
            return default if values is None else values[b]

        host = self.host_s or {}
        return [BlockCost(n, pick(self.forward_s, b, DEFAULT_BLOCK_SECONDS),
                          pick(self.backward_s, b, 2 * DEFAULT_BLOCK_SECONDS),
                          int(pick(self.activation_bytes, b, 0)), int(pick(self.input_bytes, b, 0)),
                          *(pick(host.get(kind), b, 0.0) for kind in ("forward", "recompute", "backward")),
                          pick(self.host_fetch_share, b, 0.0), int(pick(self.grad_bytes, b, 0)),
                          pick(self.optimizer_s, b, 0.0), int(pick(self.update_in_bytes, b, 0)))
                for b, n in enumerate(nbytes)]

    def with_(self, **changes) -> "CostModel":
        return replace(self, **changes)

    def count_device_updates(self, updates: dict[int, tuple[int, int]]) -> None:
        """Blocks stepped on the device (block -> (H2D, D2H) bytes a step): their states move instead of gradients."""
        if not updates or self.grad_bytes is None:
            self.update_in_bytes = None
            return
        self.update_in_bytes = [updates[b][0] if b in updates else 0 for b in range(len(self.grad_bytes))]
        self.grad_bytes = [updates[b][1] if b in updates else g for b, g in enumerate(self.grad_bytes)]
        if self.optimizer_s is not None:
            self.optimizer_s = [0.0 if b in updates else s for b, s in enumerate(self.optimizer_s)]

    def refine_host(self, seconds: dict[str, list[float]], resident: set[int]) -> int:
        """Keep the smaller of the known and a newly measured host issue time, per kind and block; the count of
        values lowered. A resident block's span lacks its fetch work: scaled back to a streamed one's."""
        if self.host_s is None or self.frozen:
            return 0
        share = [self.host_fetch_share[b] if self.host_fetch_share and b in resident else 0.0
                 for b in range(len(next(iter(seconds.values()), [])))]
        streamed_equivalent = [1.0 / (1.0 - f) if f < 1.0 else 0.0 for f in share]  # 0: nothing to learn
        lowered = 0
        for kind, values in seconds.items():
            if kind in self.host_s:
                self.host_s[kind], n = _keep_smaller(self.host_s[kind], values, streamed_equivalent)
                lowered += n
        return lowered

    def refine_compute(self, seconds: dict[str, list[float]]) -> int:
        """Keep the smaller of the known and a newly measured GPU time per block (`BlockTimer` spans; the forward
        from a recompute where there was one, as calibration takes it); the count of values lowered."""
        if self.forward_s is None or self.backward_s is None or self.frozen:
            return 0
        forward = [r or f for f, r in zip(seconds["forward"], seconds["recompute"])]
        self.forward_s, n_forward = _keep_smaller(self.forward_s, forward)
        self.backward_s, n_backward = _keep_smaller(self.backward_s, seconds["backward"])
        return n_forward + n_backward


def _keep_smaller(known: list[float], measured: list[float], scale: list[float] | None = None):
    """A new list with each measured value, scaled, where it is below the known one or that is unset; and how many
    it lowered. A measured 0 (the block did not run) or a scale of 0 teaches nothing."""
    out, lowered = list(known), 0
    for b, value in enumerate(measured):
        value *= 1.0 if scale is None else scale[b]
        if value > 0 and (out[b] <= 0 or value < out[b]):
            out[b] = value
            lowered += 1
    return out, lowered


# ---- H2D bandwidth, measured once per machine --------------------------------------------------


def h2d_bandwidth(device: torch.device, pinned: bool = True, direction: str = "h2d") -> tuple[float, str]:
    """Pinned H2D (or `direction="d2h"`) bytes/s and where the number came from ("cached", "measured", "default"):
    measured once per device name and kept in `<cache_dir>/h2d_bandwidth.json`; the CPU has no link to measure."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_H2D_BPS, "default (no device link on the CPU)"
    known = cached_bandwidth(device, pinned, direction)
    if known is not None:
        return known, "cached"
    return measure_bandwidth(device, pinned, direction), "measured"


def _bandwidth_key(device: torch.device, pinned: bool, direction: str, ranks: int) -> str:
    key = f"{torch.cuda.get_device_name(device)}|pinned={pinned}|torch={torch.__version__}"
    key += "" if direction == "h2d" else f"|{direction}"
    # Ranks of one node copying at once share the host's memory and PCIe: a number of its own.
    return key + ("" if ranks == 1 else f"|ranks={ranks}")


def cached_bandwidth(device: torch.device, pinned: bool, direction: str = "h2d", ranks: int = 1) -> float | None:
    """The bytes/s kept for this device, direction and number of ranks copying at once (None: not measured)."""
    table = _read_json(os.path.join(cache_dir(), "h2d_bandwidth.json"))
    value = table.get(_bandwidth_key(torch.device(device), pinned, direction, ranks))
    return None if value is None else float(value)


def measure_bandwidth(device: torch.device, pinned: bool, direction: str = "h2d", ranks: int = 1) -> float:
    """Measure this rank's bytes/s now (with `ranks` ranks of the node measuring at the same moment) and keep it."""
    device = torch.device(device)
    path = os.path.join(cache_dir(), "h2d_bandwidth.json")
    bps = _measure_h2d(device, pinned, direction)
    table = _read_json(path)
    table[_bandwidth_key(device, pinned, direction, ranks)] = bps
    with contextlib.suppress(OSError):  # an unwritable cache only costs a second per offload
        write_atomic(path, json.dumps(table, indent=1))  # a run killed mid-write leaves the old table
    return bps


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _measure_h2d(device: torch.device, pinned: bool, direction: str = "h2d", nbytes: int = 256 * 2**20,
                 reps: int = 4) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return nbytes * reps / (time.perf_counter() - t0)


def budget_from(config, vram_budget) -> Budget:
    """The budget from `offload(vram_budget=...)` and `conductor.vram_soft_cap_mb` / `vram_hard_cap_mb`."""
    c = config.conductor
    soft = None if c.vram_soft_cap_mb is None else int(c.vram_soft_cap_mb * 2**20)
    hard = None if c.vram_hard_cap_mb is None else int(c.vram_hard_cap_mb * 2**20)
    if vram_budget is not None:
        soft = parse_bytes(vram_budget, "offload: vram_budget")
        if hard is not None and soft > hard:
            raise BudgetError(f"offload: vram_budget {soft / 2**30:.2f} GiB is above conductor.vram_hard_cap_mb "
                              f"({hard / 2**30:.2f} GiB)")
        hard = hard if hard is not None else soft
    return Budget(soft, hard)
