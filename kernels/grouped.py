"""Grouped low-bit GEMM for mixture-of-experts stacks: one-byte weights (int8, fp8 E4M3) x bf16 activations.

With tokens sorted by expert (`offs[e]`: the end of expert e's rows), for each expert e

    y[rows of e] = x[rows of e] @ B_e,    B_e[k, n] = q[e, n, k] * s[e, n]   (rows_are_out: q[e] is [N, K])
                                          B_e[k, n] = q[e, k, n] * s[e, k]   (else: q[e] is [K, N])

as `torch._grouped_mm(x, dequantize(q, s), offs)` without the bf16 copy; grad-input: `not rows_are_out`. A program
finds its expert on the device from `offs`; rows past `offs[-1]` are left unwritten. `F32=True`: fp32 math.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from torch_stagehand.kernels import w8a16
from torch_stagehand.kernels.reference import check_grouped_args as check_args, grouped_lowbit_ref
from torch_stagehand.kernels.tuning import autotune as tune
from torch_stagehand.kernels.tuning.autotune import DEQUANT, LaunchConfig, interpreting


@triton.jit(do_not_specialize=["S"])
def _grouped_kernel(
    x_ptr, q_ptr, s_ptr, offs_ptr, y_ptr,
    S, N, K, E,
    stride_xs, stride_xk, stride_qe, stride_qk, stride_qn, stride_se, stride_sk, stride_sn, stride_ys, stride_yn,
    E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_N: tl.constexpr, F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Which expert and which of its token tiles: a cumulative sum of tiles over the padded expert axis.
    e_idx = tl.arange(0, E_P2)
    ends = tl.load(offs_ptr + e_idx, mask=e_idx < E, other=0)
    starts = tl.load(offs_ptr + e_idx - 1, mask=(e_idx >= 1) & (e_idx < E), other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)
    if pid_m >= tl.sum(tiles, 0):
        return
    expert = tl.sum((cum <= pid_m).to(tl.int32), 0)
    here = e_idx == expert
    first_tile = tl.sum(tl.where(here, cum - tiles, 0), 0)
    row0 = tl.sum(tl.where(here, starts, 0), 0) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(here, ends, 0), 0)

    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N
    q_base = q_ptr + expert.to(tl.int64) * stride_qe
    s_base = s_ptr + expert.to(tl.int64) * stride_se
    cdt: tl.constexpr = tl.float32 if F32 else x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xs + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        # No `other=` (a constant can not be cast to fp8): the masked lanes are zeroed after the conversion.
        w = tl.where(w_ok, tl.load(q_base + ks[:, None] * stride_qk + cols[None, :] * stride_qn, mask=w_ok).to(
            tl.float32), 0.0)
        if SCALE_N:
            b = w.to(cdt)
        else:
            sk = tl.load(s_base + ks * stride_sk, mask=k_ok, other=0.0)
            b = (w * sk[:, None]).to(cdt)  # rounded once, as the dequantized stack is
        if F32:
            acc = tl.dot(a.to(cdt), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if SCALE_N:
        sn = tl.load(s_base + cols * stride_sn, mask=col_ok, other=0.0)
        acc = acc * sn[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ys + cols[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_lowbit_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                          rows_are_out: bool, tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """The Triton kernel; `tile` = (block_m, block_n, block_k, warps, stages), a default if None."""
    check_args(x, q, scale, offs, rows_are_out)
    e, r, c = q.shape
    n, k = (r, c) if rows_are_out else (c, r)
    s_rows = x.shape[0]
    y = torch.empty(s_rows, n, dtype=x.dtype, device=x.device)
    if s_rows == 0:
        return y
    f32 = x.dtype == torch.float32 or interpreting()
    bm, bn, bk, warps, stages = tile or ((32, 32, 32, 4, 2) if f32 else (64, 128, 64, 4, 3)
                                         if s_rows // max(e, 1) <= 64 else (128, 128, 64, 8, 3))
    # q[e] as B_e[k, n]: strides along the reduction and the output dimension.
    stride_qk, stride_qn = (q.stride(2), q.stride(1)) if rows_are_out else (q.stride(1), q.stride(2))
    stride_sk, stride_sn = (0, scale.stride(1)) if rows_are_out else (scale.stride(1), 0)
    grid = (-(-s_rows // bm) + e, -(-n // bn))
    _grouped_kernel[grid](x, q, scale, offs, y, s_rows, n, k, e, x.stride(0), x.stride(1), q.stride(0), stride_qk,
                          stride_qn, scale.stride(0), stride_sk, stride_sn, y.stride(0), y.stride(1),
                          E_P2=max(16, triton.next_power_of_2(e)), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                          SCALE_N=rows_are_out, F32=f32, num_warps=warps, num_stages=stages)
    return y


def tiles(rows_per_expert: int) -> list[tuple[int, int, int, int, int]]:
    """The tiles the autotuner tries: token tiles near the rows an expert gets."""
    if rows_per_expert <= 32:
        return [(16, 128, 128, 4, 4), (32, 128, 64, 4, 4), (32, 64, 128, 4, 4), (64, 128, 64, 4, 3)]
    if rows_per_expert <= 128:
        return [(64, 128, 64, 4, 3), (64, 64, 128, 4, 4), (64, 256, 64, 8, 3), (128, 128, 64, 8, 3)]
    return [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 3), (128, 128, 32, 4, 4)]


def dequantized(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stack in `dtype`, one pass of the W8A16 dequantize kernel over its E x R stored rows."""
    e, r, c = q.shape
    q, scale = q.contiguous(), scale.contiguous()  # views of a slot are already
    out = torch.empty(e, r, c, dtype=dtype, device=q.device)
    rows = e * r
    w8a16._dequant_kernel[(-(-rows // 32), -(-c // 256))](q, scale, out, rows, c, c, BLOCK_N=32, BLOCK_K=256,
                                                         num_warps=4)
    return out


def dequant_grouped_mm(x, q, scale, offs, rows_are_out):
    """The other candidate: a bf16 copy of the stack, then torch's grouped GEMM (cuBLAS / CUTLASS)."""
    dense = dequantized(q, scale, x.dtype)
    return torch._grouped_mm(x, dense.transpose(-2, -1) if rows_are_out else dense, offs=offs)


def has_scaled_grouped_mm(x: torch.Tensor, q: torch.Tensor, rows_are_out: bool) -> bool:
    """Can `_scaled_grouped_mm` (Hopper, rowwise) take this fp8 stack: scale on the output dim, 16-aligned dims?"""
    return (q.dtype == torch.float8_e4m3fn and rows_are_out and x.is_cuda and x.dtype == torch.bfloat16
            and hasattr(torch, "_scaled_grouped_mm")
            and _hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())
            and q.shape[1] % 16 == 0 and q.shape[2] % 16 == 0)


def scaled_grouped_mm(x, q, scale, offs):
    """y = x @ (q * s)^T per expert, x quantized to E4M3 per row as fp8 Linears do (precision/fp8.py)."""
    from torch_stagehand.kernels.fp8_quant import quantize_rows

    xq, xs = quantize_rows(x)
    return torch._scaled_grouped_mm(xq, q.transpose(-2, -1), xs.reshape(-1).float(), scale.float(), offs=offs,
                                    out_dtype=x.dtype)


def _tile_of(cfg) -> tuple[int, int, int, int, int]:
    return (cfg.block_m, cfg.block_o, cfg.block_r, cfg.num_warps, cfg.num_stages)


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:  # asked at every call of the op: once per device
    return torch.cuda.get_device_capability(index)[0] == 9


def _options(rows_per_expert: int) -> list:
    """The autotuner's candidates, made once per tile regime (the op asks at every call)."""
    return _options_of(tuple(tiles(rows_per_expert)))


@functools.lru_cache(maxsize=None)
def _options_of(tile_set: tuple) -> list:
    return [LaunchConfig(bn, bm, bk, 1, w, st) for bm, bn, bk, w, st in tile_set] + [DEQUANT]


def grouped_lowbit(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                   rows_are_out: bool) -> torch.Tensor:
    """On CUDA: fp8 rowwise tensor cores where they apply, else the autotuner's pick between the Triton kernel's
    tiles and dequantize + grouped GEMM. Elsewhere the torch twin."""
    if not x.is_cuda:
        return grouped_lowbit_ref(x, q, scale, offs, rows_are_out)
    check_args(x, q, scale, offs, rows_are_out)
    if has_scaled_grouped_mm(x, q, rows_are_out):
        return scaled_grouped_mm(x, q, scale, offs)
    e, r, c = q.shape
    n, k = (r, c) if rows_are_out else (c, r)
    options = _options(x.shape[0] // max(e, 1))
    kind = f"grouped-{e}-{'out' if rows_are_out else 'in'}-{str(q.dtype).replace('torch.', '')}"
    key = (kind, x.device, tune.bucket(max(x.shape[0], 1)), n, k, x.dtype)

    def run(cfg, w):
        if cfg.mode == "dequant":
            return dequant_grouped_mm(x, w, scale, offs, rows_are_out)
        return grouped_lowbit_triton(x, w, scale, offs, rows_are_out, _tile_of(cfg))

    def check(cfg):  # tuning only (it reads offs on the host): rows past offs[-1] (sentinels) are not written
        routed_rows = int(offs[-1]) if offs.numel() else 0
        out = run(cfg, q)[:routed_rows]
        return tune.sample_check(out, lambda rows, cols: _reference_sample(x, q, scale, offs, rows, cols,
                                                                           rows_are_out), n, routed_rows)

    cfg = tune.pick(kind, key, x.shape[0], n, k, x.device, run, q, check, options=options)
    return run(cfg, q)


def _reference_sample(x, q, scale, offs, rows, cols, rows_are_out):
    """fp32 y[rows][:, cols] and the same sums over absolute values (tune.sample_check's contract)."""
    expert = torch.searchsorted(offs.long(), rows, right=True).clamp_max(q.shape[0] - 1)
    xs = x[rows].float()
    # The sampled columns first: a whole stack per sampled row would be gigabytes at full size.
    if rows_are_out:  # B_e[k, n] = q[e, n, k] * s[e, n]
        w = q[:, cols, :][expert].float() * scale[:, cols][expert].unsqueeze(-1)
        prods = xs.unsqueeze(1) * w
    else:  # B_e[k, n] = q[e, k, n] * s[e, k]
        w = q[:, :, cols][expert].float() * scale[expert].unsqueeze(-1)
        prods = xs.unsqueeze(-1) * w
        prods = prods.transpose(1, 2)
    return prods.sum(-1), prods.abs().sum(-1)
