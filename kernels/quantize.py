"""Per-row symmetric INT8 quantization of Linear weights: `qweight[o, i] = round(w[o, i] / scale[o])` in
[-127, 127], an fp32 `scale[o]` per output row. "absmax": scale = max|w_row| / 127. "mse": the least squared error
over coarse then fine clipping ratios and least-squares refits, never worse than absmax on any row.
"""

from __future__ import annotations

import torch

from torch_stagehand.environment import tunable

QMAX = 127
# Coarse ratios find heavy-tailed rows; the fine grid matters more on trained weights (optimum mostly 0.95-1.0).
_COARSE = torch.linspace(1.0, 0.3, 15).tolist()
_FINE = torch.linspace(-0.025, 0.025, 11).tolist()
_REFITS = 2
METHODS = ("mse", "absmax")


def quantize_per_row(w: torch.Tensor, method: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    """Return (qweight int8 [out, in], scale fp32 [out]) for a 2-D floating-point weight."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"quantize_per_row: expected a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"quantize_per_row: expected a 2-D weight, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"quantize_per_row: expected a floating-point weight, got {w.dtype}")
    if method not in METHODS:
        raise ValueError(f"quantize_per_row: method must be 'mse' or 'absmax', got {method!r}")
    if not torch.isfinite(w).all():
        raise ValueError("quantize_per_row: weight holds NaN or Inf")
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    # Rows per chunk (bounding the fp32 copies); more on a GPU, where the search is bound by its launches.
    chunk = tunable("quantize_rows_per_chunk")
    if w.is_cuda:
        chunk = max(chunk, tunable("quantize_gpu_chunk") // max(1, w.shape[1]))
    for start in range(0, w.shape[0], chunk):
        rows = w[start : start + chunk].float()
        s = _best_scale(rows) if method == "mse" else _absmax_scale(rows)
        scale[start : start + rows.shape[0]] = s
        q[start : start + rows.shape[0]] = torch.round(rows / s[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """qweight * scale[:, None] in `dtype` (the padding columns of a slab included)."""
    if qweight.dim() != 2 or scale.numel() != qweight.shape[0]:
        raise ValueError(f"dequantize: qweight {tuple(qweight.shape)} and scale {tuple(scale.shape)} disagree "
                         "(need a 2-D qweight with one scale per row)")
    return (qweight.float() * scale.float().reshape(-1, 1)).to(dtype)


def _absmax_scale(rows: torch.Tensor) -> torch.Tensor:
    # An all-zero row gets scale 1 (any scale reproduces it exactly; 0 would divide by zero).
    absmax = rows.abs().amax(dim=1)
    return torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))


def _err(rows: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    q = torch.round(rows / s[:, None]).clamp_(-QMAX, QMAX)
    return (q.mul_(s[:, None]).sub_(rows)).pow_(2).sum(dim=1)


def _best_scale(rows: torch.Tensor) -> torch.Tensor:
    base = _absmax_scale(rows)
    best_s, best_err = base.clone(), _err(rows, base)
    best_ratio = torch.ones_like(base)

    def consider(s, ratio=None):
        nonlocal best_s, best_err, best_ratio
        e = _err(rows, s)
        better = e < best_err
        best_err = torch.where(better, e, best_err)
        best_s = torch.where(better, s, best_s)
        if ratio is not None:
            best_ratio = torch.where(better, ratio, best_ratio)

    for r in _COARSE[1:]:
        consider(base * r, torch.full_like(base, r))
    coarse = best_ratio.clone()
    for d in _FINE:
        r = (coarse + d).clamp_(max=1.0)
        consider(base * r, r)
    for _ in range(_REFITS):
        q = torch.round(rows / best_s[:, None]).clamp_(-QMAX, QMAX)
        qq = (q * q).sum(dim=1)
        s = torch.where(qq > 0, (rows * q).sum(dim=1) / qq.clamp_min(1), best_s)
        consider(torch.where(s > 0, s, best_s))
    return best_s
