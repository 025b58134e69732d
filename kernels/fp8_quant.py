"""Per-row E4M3 quantization of an activation (or a gradient times a column scale) in one kernel, for the fp8
GEMMs: v = x[m, :] (* col_scale) in fp32, scale_m = max(max|v| / 448, 1e-12), q[m, :] = E4M3(clamp(v / scale_m,
-448, 448)). `quantize_rows_ref` is its torch twin (bit for bit on the GPU; the interpreter rounds E4M3 wrongly).
"""

from __future__ import annotations

import torch

from torch_stagehand.kernels.fallback import warn_reference_fallback
from torch_stagehand.kernels.launch_memo import Executor, LaunchMemo, tensor_key
from torch_stagehand.environment import env

TRITON_IMPORT_ERROR: BaseException | None = None
try:  # a broken Triton install must not break the CPU path (the twin); CUDA calls then warn once
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception as e:  # pragma: no cover - depends on the install
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = e

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero row gets a tiny scale instead of a division by zero
_BLOCK = 1024
QUANT_MEMO = LaunchMemo("fp8 quantize_rows")  # two calls per fp8 Linear: replayed like the W8A16 launches
TRANSPOSE_MEMO = LaunchMemo("fp8 transpose")  # one per grad-input: the column-major weight _scaled_mm takes
_TILE = 128  # 128-byte rows: whole cache lines in and out


def _jit(fn):
    return triton.jit(fn) if HAS_TRITON else fn


@_jit
def _load_scaled(x_row, c_ptr, k0, K, HAS_COL: tl.constexpr, BLOCK: tl.constexpr):
    """Elements k0 .. k0 + BLOCK of a row in fp32 (times the column scale), their offsets and mask."""
    offs = k0 + tl.arange(0, BLOCK)
    ok = offs < K
    v = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_COL:
        v = v * tl.load(c_ptr + offs, mask=ok, other=0.0)
    return v, offs, ok


@_jit
def _quant_rows_kernel(x_ptr, c_ptr, q_ptr, s_ptr, K, stride_xm, HAS_COL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v, offs, ok = _load_scaled(x_row, c_ptr, k0, K, HAS_COL, BLOCK)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        v, offs, ok = _load_scaled(x_row, c_ptr, k0, K, HAS_COL, BLOCK)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)  # IEEE division, as torch
        tl.store(q_ptr + row * K + offs, v.to(q_ptr.dtype.element_ty), mask=ok)


@_jit
def _transpose_kernel(src, dst, N, K, TILE: tl.constexpr):
    """dst[k, n] = src[n, k] for one TILE x TILE tile: coalesced reads along k, coalesced writes along n."""
    n0, k0 = tl.program_id(0) * TILE, tl.program_id(1) * TILE
    rn = (n0 + tl.arange(0, TILE)).to(tl.int64)
    rk = (k0 + tl.arange(0, TILE)).to(tl.int64)
    ok = (rn[:, None] < N) & (rk[None, :] < K)
    tile = tl.load(src + rn[:, None] * K + rk[None, :], mask=ok)
    tl.store(dst + rk[None, :] * N + rn[:, None], tile, mask=ok)


def transpose_bytes(q: torch.Tensor, tile: int = _TILE) -> torch.Tensor:
    """[n, k] contiguous 1-byte tensor -> its transpose [k, n], contiguous, by a tiled kernel (whole rows)."""
    if q.dim() != 2 or q.element_size() != 1 or not q.is_contiguous():
        raise ValueError(f"fp8 transpose_bytes: expected a contiguous 2-D 1-byte tensor, got {tuple(q.shape)} "
                         f"{q.dtype} strides {q.stride()}")
    # The CPU tests run the kernel under the interpreter; a GPU call skips the env read.
    interpreting = not q.is_cuda and env("TRITON_INTERPRET")
    if not (HAS_TRITON and (q.is_cuda or interpreting)):
        if q.is_cuda:
            warn_reference_fallback("the fp8 quantize and transpose kernels", TRITON_IMPORT_ERROR)
        return q.t().contiguous()
    n, k = q.shape
    memo = TRANSPOSE_MEMO.enabled(interpreting)
    src = q.view(torch.uint8)  # bytes move unchanged, whatever they mean
    key = (tensor_key(src), tile)
    if memo:
        replay = TRANSPOSE_MEMO.get(key)
        if replay is not None:
            return replay(dict(src=src))["dst"].view(q.dtype)
    ex = Executor(dict(src=src), record=memo)
    dst = ex.buffer("dst", (k, n), torch.uint8, q.device)
    if n and k:
        ex.kernel(_transpose_kernel, (triton.cdiv(n, tile), triton.cdiv(k, tile)), src, dst, n, k, TILE=tile,
                  num_warps=8 if tile >= 128 else 4)
    if memo:
        TRANSPOSE_MEMO.add(key, ex, q.device)
    return dst.view(q.dtype)


def quantize_rows_ref(x2: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[m, k] -> (E4M3 [m, k], fp32 [m, 1]) in torch ops: the kernel's twin."""
    v = x2.float()
    if col_scale is not None:
        v = v * col_scale.float().view(1, -1)
    scale = (v.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(MIN_SCALE)
    return (v / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_rows(x2: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3 of a 2-D [m, k] tensor (optionally times an fp32 [k] column scale), and its [m, 1] scale."""
    if x2.dim() != 2:
        raise ValueError(f"fp8 quantize_rows: expected a 2-D [m, k] tensor, got shape {tuple(x2.shape)}")
    if col_scale is not None and col_scale.numel() != x2.shape[1]:
        raise ValueError(f"fp8 quantize_rows: col_scale has {col_scale.numel()} elements, the rows {x2.shape[1]}")
    if not (x2.is_cuda and HAS_TRITON):
        if x2.is_cuda:
            warn_reference_fallback("the fp8 quantize and transpose kernels", TRITON_IMPORT_ERROR)
        return quantize_rows_ref(x2, col_scale)
    # An interpreted launch is never recorded (the Executor sees no compiled binary), so no interpreter check.
    memo = QUANT_MEMO.enabled(interpreting=False)
    if memo:
        key = (tensor_key(x2), tensor_key(col_scale))
        replay = QUANT_MEMO.get(key)
        if replay is not None:
            t = replay(dict(x=x2, col=col_scale))
            return t["q"], t["scale"]
    given = (x2, col_scale)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    col = col_scale.reshape(-1).float().contiguous() if col_scale is not None else None
    m, k = x2.shape
    memo = memo and x2 is given[0] and (col is None or col.data_ptr() == col_scale.data_ptr())
    ex = Executor(dict(x=x2, col=col), record=memo)
    q = ex.buffer("q", (m, k), E4M3, x2.device)
    scale = ex.buffer("scale", (m, 1), torch.float32, x2.device)
    if m == 0:
        return q, scale
    ex.kernel(_quant_rows_kernel, (m,), x2, scale if col is None else col, q, scale, k, x2.stride(0),
              HAS_COL=col is not None, BLOCK=_BLOCK, num_warps=4)
    if memo:
        QUANT_MEMO.add(key, ex, x2.device)
    return q, scale
