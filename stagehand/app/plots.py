"""The demo's picture (loss, bytes streamed per step, the per-block precision map), the plan's timeline, and
what every plot shares. matplotlib is imported when a figure is drawn (the Agg backend: no display needed).
"""

from __future__ import annotations

import io
import os
from typing import Any

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.atomic_file import write_atomic

from torch_stagehand.app.colors import precision_colors


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 110) -> str:
    """The figure as a PNG at `path`, written whole (rendered in memory, then written atomically), and closed."""
    png = io.BytesIO()
    fig.savefig(png, dpi=dpi, format="png")
    write_atomic(os.path.abspath(path), png.getvalue())
    pyplot().close(fig)
    return path


def _short(name: str) -> str:
    for prefix in ("base_model.model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def demo_figure(losses: list[float], records: list[dict[str, Any]], blocks: list[str], path: str,
                title: str = "stagehand demo") -> str:
    """Write a PNG with three panels to `path`; returns the path."""
    fig, (ax_loss, ax_bytes, ax_prec) = pyplot().subplots(
        3, 1, figsize=(9, 8.5), gridspec_kw={"height_ratios": [3, 1.6, 1.6]}, constrained_layout=True)
    fig.suptitle(title, fontsize=12)

    steps = list(range(len(losses)))
    ax_loss.plot(steps, losses, ".", color="#999999", markersize=4, label="loss per step")
    window = max(1, len(losses) // 10)
    ax_loss.plot(steps, _moving_average(losses, window), "-", color="#c0392b", linewidth=2,
                 label=f"moving average ({window} steps)")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats / byte)")
    ax_loss.set_title("training loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(loc="upper right")

    rec_steps = [r.get("step_id", i) for i, r in enumerate(records)]
    mb = [r.get("h2d_bytes", 0) / 1e6 for r in records]
    ax_bytes.bar(rec_steps, mb, color="#5b8c5a", width=0.8)
    stalls = [r.get("sync_fetches", 0) for r in records]
    if any(stalls):
        ax_bytes.plot([s for s, n in zip(rec_steps, stalls) if n], [m for m, n in zip(mb, stalls) if n], "x",
                      color="#c0392b", label="step with a synchronous fetch")
        ax_bytes.legend(loc="upper right")
    ax_bytes.set_xlabel("step")
    ax_bytes.set_ylabel("MB host -> device")
    ax_bytes.set_title(f"weights streamed per step (telemetry; {sum(mb):.1f} MB in all)")
    ax_bytes.grid(alpha=0.3, axis="y")

    draw_precision_map(ax_prec, records, list(range(len(blocks))), [f"{i} {_short(b)}" for i, b in enumerate(blocks)],
                       extent=(-0.5, max(len(records), 1) - 0.5, len(blocks) - 0.5, -0.5))
    ax_prec.set_title("precision of each block's weight stream")
    return save_figure(fig, path)


def draw_precision_map(ax, records: list[dict[str, Any]], blocks: list[int], labels: list[str],
                       extent: tuple) -> dict[str, str]:
    """Each block's precision at each record (`record["precision"][str(block)]`) as a heatmap on `ax` (a row a
    block, labelled `labels`; steps along x), and its legend, in the colours of `precision_colors` (also for a
    precision this process has not registered); returns the colours used."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    colors = precision_colors(p for r in records for p in r.get("precision", {}).values())
    names = list(colors)
    grid = [[names.index(r.get("precision", {}).get(str(b), precisions.FULL)) for r in records] for b in blocks]
    if not records:
        grid = [[0] for _ in blocks]
    # vmin / vmax at the first and last index: index i takes exactly the i-th colour of the list.
    ax.imshow(grid or [[0]], aspect="auto", interpolation="nearest", cmap=ListedColormap(list(colors.values())),
              vmin=0, vmax=max(len(names) - 1, 1), origin="upper", extent=extent)
    ax.legend(handles=[Patch(color=c, label=n) for n, c in colors.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_yticks(range(len(blocks)), labels, fontsize=8)
    ax.set_xlabel("step")
    return colors


def timeline_figure(lanes: list[tuple[str, int, float, float]], blocks: list[str], path: str, title: str) -> str:
    """One step's lanes (host issue, H2D, D2H, compute, and under full fine-tuning the host optimizer) as bars per
    block: where the copies hide behind compute, and where the host, not the GPU, sets the pace."""
    names = ["host", "h2d", "d2h", "compute"] + (["optimizer"] if any(lane[0] == "optimizer" for lane in lanes) else [])
    colors = {"host": "#8a8a8a", "h2d": "#3b6fb6", "d2h": "#e8892b", "compute": "#2e9e5b", "optimizer": "#8e44ad"}
    fig, ax = pyplot().subplots(figsize=(11, 2.8))
    for lane, block, start, end in lanes:
        y = names.index(lane)
        ax.broken_barh([(start * 1e3, max(end - start, 1e-9) * 1e3)], (y - 0.4, 0.8), facecolors=colors[lane],
                       edgecolors="white", linewidth=0.4)
        if len(blocks) <= 24 and end - start > 0:
            ax.text((start + end) / 2 * 1e3, y, str(block), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(names)), [n.upper() if n in ("h2d", "d2h") else n for n in names])
    ax.set_xlabel("ms (predicted)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
