"""`stagehand plot telemetry.jsonl`: three PNGs from a run's telemetry (one JSON line per step).

- `timeline.png`: each step's phases (forward, backward, optimizer, ...) as stacked bars, the H2D
  traffic rate of the step (bytes streamed / step time) and the steps with a synchronous fetch (stall).
- `memory.png`: GPU memory (`vram_allocated_mb`, `vram_peak_mb`: CUDA runs), host resident memory
  (`host_rss_mb`) and the streamed weights held in device slots (`peak_streamed_bytes`), per step.
- `precision.png`: the precision of each block's weight stream at each step (a heatmap).

Fields a record lacks (older files, a CPU run's GPU memory) are left out of the plot and said so in its title.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from torch_stagehand.app.plots import draw_precision_map, pyplot, save_figure

PHASE_COLORS = {"forward": "#3b6fb6", "backward": "#e8892b", "optimizer": "#2e9e5b", "step_begin": "#7f8c8d"}


class TelemetryFileError(ValueError):
    """The telemetry file is missing, empty, or has a line that is not a step record."""


def load_records(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        raise TelemetryFileError(f"{path!r} is not a file (give the telemetry.jsonl a run wrote)")
    records = []
    with open(path) as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines) and not line.endswith("\n"):  # a run killed mid-write
                warnings.warn(f"{path}:{number}: a torn last line (the run was stopped mid-write); skipped",
                              stacklevel=2)
                continue
            raise TelemetryFileError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or "step_id" not in record:
            raise TelemetryFileError(f"{path}:{number}: not a telemetry step record (no step_id)")
        records.append(record)
    if not records:
        raise TelemetryFileError(f"{path!r} has no step records")
    return records


def timeline_figure(records: list[dict[str, Any]], path: str, title: str) -> str:
    steps = [r["step_id"] for r in records]
    phases = sorted({p for r in records for p in r.get("phase_durations", {})},
                    key=lambda p: (list(PHASE_COLORS).index(p) if p in PHASE_COLORS else 99, p))
    fig, (ax_t, ax_bw) = pyplot().subplots(2, 1, figsize=(9, 6.5), sharex=True, constrained_layout=True,
                                      gridspec_kw={"height_ratios": [2, 1.3]})
    fig.suptitle(f"{title}: step timeline", fontsize=12)
    bottom = [0.0] * len(records)
    for phase in phases:
        ms = [r.get("phase_durations", {}).get(phase, 0.0) * 1e3 for r in records]
        ax_t.bar(steps, ms, bottom=bottom, width=0.8, label=phase, color=PHASE_COLORS.get(phase, "#8e44ad"))
        bottom = [b + m for b, m in zip(bottom, ms)]
    stalls = [(s, b) for s, b, r in zip(steps, bottom, records) if r.get("sync_fetches", 0)]
    if stalls:
        ax_t.plot(*zip(*stalls), "v", color="#c0392b", label="synchronous fetch (stall)")
    ax_t.set_ylabel("ms")
    ax_t.set_title(f"phases per step ({sum(r.get('sync_fetches', 0) for r in records)} synchronous fetches in all)")
    ax_t.legend(loc="upper right", fontsize=8)
    ax_t.grid(alpha=0.3, axis="y")

    seconds = [max(sum(r.get("phase_durations", {}).values()), 1e-9) for r in records]
    gbps = [r.get("h2d_bytes", 0) / s / 1e9 for r, s in zip(records, seconds)]
    mb = [r.get("h2d_bytes", 0) / 1e6 for r in records]
    ax_bw.plot(steps, gbps, "o-", color="#5b8c5a", label="H2D GB/s (bytes / step time)")
    ax_bw.set_ylabel("GB/s")
    ax_bw.set_xlabel("step")
    ax_mb = ax_bw.twinx()
    ax_mb.bar(steps, mb, width=0.5, alpha=0.25, color="#5b8c5a", label="MB streamed")
    ax_mb.set_ylabel("MB streamed")
    ax_bw.set_title(f"host -> device traffic ({sum(mb):,.1f} MB in {len(records)} steps)")
    ax_bw.grid(alpha=0.3)
    return save_figure(fig, path)


def memory_figure(records: list[dict[str, Any]], path: str, title: str) -> str:
    steps = [r["step_id"] for r in records]
    fig, ax = pyplot().subplots(figsize=(9, 4.5), constrained_layout=True)
    series = [("vram_allocated_mb", "GPU allocated", "#3b6fb6", "-"), ("vram_peak_mb", "GPU peak", "#3b6fb6", "--"),
              ("host_rss_mb", "host resident (RSS)", "#e8892b", "-")]
    missing = []
    for key, label, color, style in series:
        if any(key in r for r in records):
            ax.plot(steps, [r.get(key) for r in records], style, color=color, marker=".", label=label)
        else:
            missing.append(label)
    slots = [r.get("peak_streamed_bytes", 0) / 2**20 for r in records]
    ax.plot(steps, slots, "-", color="#2e9e5b", marker=".", label="streamed weights in device slots (peak)")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    note = f" (not in this file: {', '.join(missing)})" if missing else ""
    ax.set_title(f"{title}: memory per step{note}", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return save_figure(fig, path)


def precision_figure(records: list[dict[str, Any]], path: str, title: str) -> str:
    blocks = sorted({int(b) for r in records for b in r.get("precision", {})})
    fig, ax = pyplot().subplots(figsize=(9, 1.2 + 0.3 * max(len(blocks), 2)), constrained_layout=True)
    steps = [r["step_id"] for r in records]
    draw_precision_map(ax, records, blocks, [f"block {b}" for b in blocks],
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, len(blocks) - 0.5, -0.5))
    changes = sum(1 for a, b in zip(records, records[1:]) if a.get("precision") != b.get("precision"))
    ax.set_title(f"{title}: precision of each block's weight stream ({changes} map changes)", fontsize=11)
    return save_figure(fig, path)


def plot_telemetry(path: str, out: str, title: str | None = None) -> dict[str, str]:
    """Write timeline.png, memory.png and precision.png into `out`; returns {name: path}."""
    records = load_records(path)
    os.makedirs(out, exist_ok=True)
    title = title or os.path.basename(os.path.dirname(os.path.abspath(path))) or "telemetry"
    return {
        "timeline": timeline_figure(records, os.path.join(out, "timeline.png"), title),
        "memory": memory_figure(records, os.path.join(out, "memory.png"), title),
        "precision": precision_figure(records, os.path.join(out, "precision.png"), title),
    }
