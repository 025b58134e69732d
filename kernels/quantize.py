"""Per-row symmetric INT8 quantization of Linear weights: `qweight[o, i] = round(w[o, i] / scale[o])` in
[-127, 127], an fp32 `scale[o]` per output row. "absmax": scale = max|w_row| / 127. "mse": the least squared error
over coarse then fine clipping ratios and least-squares refits, never worse than absmax on any row.

On a GPU the search's passes over the weights are Triton kernels that read each row once per batch of candidate
scales (all coarse ratios, then all fine ones; a refit's two sums in one pass): a 7B model's weights quantize in a
fraction of a second, where one torch op per candidate and step reads and writes them ~300 times. The same
quantization (IEEE division, round half to even, the same clamp); the errors' sums differ from torch's in order
and in fused multiply-adds, so a scale whose error ties another's within fp32 rounding may be the other one.
"""

from __future__ import annotations

import torch

from torch_stagehand.environment import tunable

try:  # a broken Triton install must not break quantization: the torch search runs instead
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAS_TRITON = False

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
    passes = KernelPasses() if HAS_TRITON and w.is_cuda and w.shape[1] > 0 else TorchPasses()
    for start in range(0, w.shape[0], chunk):
        rows = w[start : start + chunk].float()
        s = _best_scale(rows, passes) if method == "mse" else _absmax_scale(rows)
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


class TorchPasses:
    """The search's passes over a chunk of rows as torch ops, one candidate at a time (the CPU's)."""

    def errors(self, rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """[R, K] squared errors of `rows` quantized with each of the K candidate scales of its row."""
        return torch.stack([_err(rows, scales[:, k]) for k in range(scales.shape[1])], dim=1)

    def refit_sums(self, rows: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum w q, sum q q) per row, q the rows quantized with `s`: a least-squares refit's numerator and
        denominator."""
        q = torch.round(rows / s[:, None]).clamp_(-QMAX, QMAX)
        return (rows * q).sum(dim=1), (q * q).sum(dim=1)


class KernelPasses:
    """The same passes as Triton kernels: each reads the rows once for all the candidates it is given."""

    BLOCK = 256  # columns a program holds per candidate

    def errors(self, rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        rows, (n, k) = rows.contiguous(), scales.shape  # the kernel reads each row's columns in a run
        out = torch.empty((n, k), dtype=torch.float32, device=rows.device)
        if n:
            _errors_kernel[(n,)](rows, scales.contiguous(), out, rows.shape[1], rows.stride(0), K=k,
                                 KP=max(2, triton.next_power_of_2(k)), BLOCK=self.BLOCK, num_warps=4)
        return out

    def refit_sums(self, rows: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, n = rows.contiguous(), rows.shape[0]
        out = torch.empty((n, 2), dtype=torch.float32, device=rows.device)
        if n:
            _refit_kernel[(n,)](rows, s.contiguous(), out, rows.shape[1], rows.stride(0), BLOCK=4 * self.BLOCK,
                                num_warps=4)
        return out[:, 0], out[:, 1]


def _err(rows: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    q = torch.round(rows / s[:, None]).clamp_(-QMAX, QMAX)
    return (q.mul_(s[:, None]).sub_(rows)).pow_(2).sum(dim=1)


def _best_scale(rows: torch.Tensor, passes=None) -> torch.Tensor:
    passes = passes if passes is not None else TorchPasses()
    base = _absmax_scale(rows)
    best_s, best_err = base, None
    best_ratio = torch.ones_like(base)

    def consider(candidates: torch.Tensor, ratios: torch.Tensor | None = None) -> None:
        """Keep, per row, the first candidate whose error is below every one before it (base's included)."""
        nonlocal best_s, best_err, best_ratio
        errs = passes.errors(rows, candidates)
        for k in range(candidates.shape[1]):
            if best_err is None:
                best_err = errs[:, k]
                continue
            better = errs[:, k] < best_err
            best_err = torch.where(better, errs[:, k], best_err)
            best_s = torch.where(better, candidates[:, k], best_s)
            if ratios is not None:
                best_ratio = torch.where(better, ratios[:, k], best_ratio)

    coarse = torch.tensor(_COARSE, dtype=torch.float32, device=rows.device).expand(base.shape[0], -1)
    consider(base[:, None] * coarse, coarse)  # _COARSE[0] is 1.0: base itself, the first error kept
    fine = (best_ratio[:, None] + torch.tensor(_FINE, dtype=torch.float32, device=rows.device)).clamp_(max=1.0)
    consider(base[:, None] * fine, fine)
    for _ in range(_REFITS):
        wq, qq = passes.refit_sums(rows, best_s)
        s = torch.where(qq > 0, wq / qq.clamp_min(1), best_s)
        consider(torch.where(s > 0, s, best_s)[:, None])
    return best_s


if HAS_TRITON:
    # 1.5 * 2**23: adding then subtracting it rounds an fp32 |v| < 2**22 half to even (a constexpr: a kernel reads
    # no other global)
    _MAGIC = tl.constexpr(12582912.0)

    @triton.jit
    def _quantized(w, s):
        """round(w / s) clamped to [-QMAX, QMAX], as torch.round (half to even) after an IEEE division."""
        v = tl.math.div_rn(w, s)
        v = (v + _MAGIC) - _MAGIC  # past 2**22 the rounding is off, but such a v clamps to +-127 all the same
        return tl.minimum(tl.maximum(v, -127.0), 127.0)

    @triton.jit
    def _errors_kernel(rows_ptr, s_ptr, out_ptr, C, stride_r, K: tl.constexpr, KP: tl.constexpr,
                       BLOCK: tl.constexpr):
        """out[r, k] = sum_c (q(w[r, c], s[r, k]) * s[r, k] - w[r, c])^2: one program a row, all K at once."""
        row = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, KP)
        s = tl.load(s_ptr + row * K + ks, mask=ks < K, other=1.0)
        acc = tl.zeros((KP,), dtype=tl.float32)
        for c0 in range(0, C, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            w = tl.load(rows_ptr + row * stride_r + offs, mask=offs < C, other=0.0)  # a padded 0 adds 0
            d = _quantized(w[None, :], s[:, None]) * s[:, None] - w[None, :]
            acc += tl.sum(d * d, axis=1)
        tl.store(out_ptr + row * K + ks, acc, mask=ks < K)

    @triton.jit
    def _refit_kernel(rows_ptr, s_ptr, out_ptr, C, stride_r, BLOCK: tl.constexpr):
        """out[r] = (sum_c w q, sum_c q q), q = q(w[r, c], s[r])."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.load(s_ptr + row)
        wq = tl.zeros((BLOCK,), dtype=tl.float32)
        qq = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, C, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            w = tl.load(rows_ptr + row * stride_r + offs, mask=offs < C, other=0.0)
            q = _quantized(w, s)
            wq += w * q
            qq += q * q
        tl.store(out_ptr + row * 2, tl.sum(wq, axis=0))
        tl.store(out_ptr + row * 2 + 1, tl.sum(qq, axis=0))
