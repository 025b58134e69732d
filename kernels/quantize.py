"""Per-row symmetric INT8 quantization of Linear weights.

`qweight[o, i] = round(w[o, i] / scale[o])` clamped to [-127, 127] with an fp32
`scale[o]` per output row (zero point 0: symmetric, as squareq-int8-slab.txt).
"absmax" sets `scale = max|w_row| / 127`; "mse" searches a clipping ratio per
row that minimises the row's reconstruction error, which beats absmax when a
row has outliers (the rest of the row gets finer steps).
"""

from __future__ import annotations

import torch

QMAX = 127
# Clipping ratios tried by the "mse" search: 1.0 is absmax, so mse is never worse.
_CLIP_GRID = torch.linspace(1.0, 0.5, 26).tolist()
# Rows per chunk for the search, so a 12288x3072 weight never needs 26 fp32 copies.
_ROWS_PER_CHUNK = 1024


def quantize_per_row(w: torch.Tensor, method: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    """Return (qweight int8 [out, in], scale fp32 [out]) for a 2-D weight."""
    if w.dim() != 2:
        raise ValueError(f"quantize_per_row: expected a 2-D weight, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"quantize_per_row: expected a floating-point weight, got {w.dtype}")
    if method not in ("mse", "absmax"):
        raise ValueError(f"quantize_per_row: method must be 'mse' or 'absmax', got {method!r}")
    if not torch.isfinite(w).all():
        raise ValueError("quantize_per_row: weight holds NaN or Inf")
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for start in range(0, w.shape[0], _ROWS_PER_CHUNK):
        rows = w[start : start + _ROWS_PER_CHUNK].float()
        s = _best_scale(rows) if method == "mse" else _absmax_scale(rows)
        scale[start : start + rows.shape[0]] = s
        q[start : start + rows.shape[0]] = _quantize(rows, s)
    return q, scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def _absmax_scale(rows: torch.Tensor) -> torch.Tensor:
    # An all-zero row gets scale 1 (any scale reproduces it exactly; 0 would divide by zero).
    absmax = rows.abs().amax(dim=1)
    return torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))


def _quantize(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(rows / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)


def _best_scale(rows: torch.Tensor) -> torch.Tensor:
    base = _absmax_scale(rows)
    best_scale = base.clone()
    best_err = torch.full_like(base, float("inf"))
    for ratio in _CLIP_GRID:
        s = base * ratio
        err = (torch.round(rows / s[:, None]).clamp_(-QMAX, QMAX) * s[:, None] - rows).pow_(2).sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, s, best_scale)
    return best_scale
