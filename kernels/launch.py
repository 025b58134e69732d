"""Launchers for the W8A16 Triton kernels: argument checks, views, launches.

`int8_linear_triton` / `int8_linear_grad_input_triton` always take the Triton
path (the CPU interpreter included, for the tests); `torch_stagehand.kernels`
decides when to call them. The config of each launch comes from kernels/tune.py
(autotuned on CUDA, heuristic elsewhere) unless the caller passes one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import tune, w8a16
from .tune import LaunchConfig

_ACTS = {None: 0, "gelu_tanh": 1}
_REDUCE_BLOCK = 1024


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: in Triton 3.6 that is a constexpr_function whose host-side call
    # costs ~5 us (argument unwrapping); five per launch were a third of the host time.
    return -(-a // b)


def _interpreting() -> bool:
    return tune.interpreting()


# ----------------------------------------------------------------------------- views


def _rows(t: torch.Tensor):
    """Collapse t's leading dims to (B, T) rows with strides; copy only if impossible.

    Returns (t, M, T, stride_b, stride_t). Rows are m = b * T + t."""
    dims = []  # outer to inner, size-1 dims dropped (their stride is meaningless)
    for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:  # outer dim steps over this one exactly
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if len(dims) > 2:  # three independent strides: rare, and a copy is correct
        t = t.contiguous()
        dims = [(t.numel() // max(t.shape[-1], 1), t.shape[-1])]
    while len(dims) < 2:
        dims.insert(0, (1, 0))
    (b, sb), (tt, st) = dims
    return t, b * tt, tt, sb, st


def _check_weight(qweight, scale, bias, n_in: int, what: str, device):
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise ValueError(f"{what}: qweight must be a 2-D int8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    n, kp = qweight.shape
    if n_in > kp:
        raise ValueError(f"{what}: K={n_in} is wider than qweight's {kp} columns")
    if scale.numel() != n:
        raise ValueError(f"{what}: scale has {scale.numel()} elements, qweight has {n} rows")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"{what}: bias has {bias.numel()} elements, qweight has {n} rows")
    for name, t in (("qweight", qweight), ("scale", scale), ("bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(f"{what}: {name} is on {t.device}, the activation on {device}")
    if qweight.stride(1) != 1:  # rows must be contiguous; views into a slot always are
        qweight = qweight.contiguous()
    scale = scale.reshape(-1)
    if scale.dtype != torch.float32 or scale.stride(0) != 1:
        scale = scale.float().contiguous()
    if bias is not None:
        bias = bias.reshape(-1).contiguous()
    return qweight, scale, bias


def _check_act(t: torch.Tensor, what: str, name: str):
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: {name} must be bf16, fp16 or fp32, got {t.dtype}")
    if t.dim() < 1:
        raise ValueError(f"{what}: {name} must have at least one dimension")


_DUMMY: dict = {}


def _dummy(device) -> torch.Tensor:
    # The fp32 workspace argument of an unsplit launch: never read or written.
    if device not in _DUMMY:
        _DUMMY[device] = torch.empty(1, dtype=torch.float32, device=device)
    return _DUMMY[device]


# ----------------------------------------------------------------------------- launches


def _k_split(red: int, cfg: LaunchConfig):
    """Reduction elements per split (a multiple of block_r) and the splits actually used."""
    per = _cdiv(_cdiv(red, cfg.split), cfg.block_r) * cfg.block_r
    return per, _cdiv(red, per)


def _dequant(q, scale, k, dtype):
    """bf16/fp16 copy of q[:, :k] * scale (the dequantize + cuBLAS mode)."""
    n = q.shape[0]
    w = torch.empty((n, k), dtype=dtype, device=q.device)
    w8a16._dequant_kernel[(_cdiv(n, 32), _cdiv(k, 256))](
        q, scale, w, n, k, q.stride(0), BLOCK_N=32, BLOCK_K=256, num_warps=4,
    )
    return w


def _launch_fwd(x, T, sb, st, q, scale, bias, y, M, N, K, act, cfg: LaunchConfig, f32: bool):
    if cfg.mode == "dequant":
        w = _dequant(q, scale, K, x.dtype)
        x2d, y2d = x.reshape(M, K), y.view(M, N)  # reshape copies only a non-collapsible x
        if bias is not None:
            torch.addmm(bias.to(x.dtype), x2d, w.t(), out=y2d)
        else:
            torch.mm(x2d, w.t(), out=y2d)
        if act == 1:
            y2d.copy_(F.gelu(y2d.float(), approximate="tanh"))
        return
    per, split = _k_split(K, cfg)
    if cfg.variant and split > 1:
        raise ValueError(f"int8_linear: config {cfg} scales in registers, which a split launch cannot")
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else _dummy(x.device)
    grid = (_cdiv(N, cfg.block_o) * _cdiv(M, cfg.block_m), split)
    has_bias = bias is not None
    args = (x, q, scale, bias if has_bias else scale, y, ws, M, N, K, T, sb, st, x.stride(-1), q.stride(0), per)
    common = dict(BLOCK_N=cfg.block_o, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_r, GROUP=8, EVEN_K=(K % per == 0),
                  HAS_BIAS=has_bias, ACT=act, F32=f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    w8a16._fwd_kernel[grid](*args, SCALE_A=bool(cfg.variant), **common)
    if split > 1:
        mn = M * N
        w8a16._fwd_reduce_kernel[(_cdiv(mn, _REDUCE_BLOCK),)](
            ws, scale, bias if has_bias else scale, y, mn, N, split,
            BLOCK=_REDUCE_BLOCK, HAS_BIAS=has_bias, ACT=act, num_warps=4,
        )


def int8_linear_triton(x, qweight, scale, bias=None, activation=None, *, config: LaunchConfig | None = None):
    """Triton W8A16 forward: y = (x @ q[:, :K].T) * scale + bias, optional tanh-GeLU."""
    what = "int8_linear"
    _check_act(x, what, "x")
    if activation not in _ACTS:
        raise ValueError(f"{what}: unknown activation {activation!r} (supported: 'gelu_tanh')")
    K = x.shape[-1]
    q, scale, bias = _check_weight(qweight, scale, bias, K, what, x.device)
    N = q.shape[0]
    lead = x.shape[:-1]
    y = torch.empty((*lead, N), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    if K == 0:
        return int8_linear_ref_epilogue(y, scale, bias, activation)
    x2, M, T, sb, st = _rows(x)
    f32 = _interpreting() or x.dtype == torch.float32
    act = _ACTS[activation]

    def run(cfg, w=q):
        _launch_fwd(x2, T, sb, st, w, scale, bias, y, M, N, K, act, cfg, f32)

    def check(cfg):  # sampled elements against fp32 math on the same int8 weight
        def ref(rows, cols):
            xr, wr = x.reshape(M, K)[rows].float(), q[cols, :K].float().t()
            acc = (xr @ wr) * scale[cols]
            magnitude = (xr.abs() @ wr.abs()) * scale[cols].abs()
            if bias is not None:
                acc = acc + bias[cols].float()
                magnitude = magnitude + bias[cols].float().abs()
            return (F.gelu(acc, approximate="tanh") if act == 1 else acc), magnitude

        return tune.sample_check(y, ref, N, M)

    if config is None:
        key = ("fwd", x.device, tune.bucket(M), N, K, x.dtype)
        config = tune.pick("fwd", key, M, N, K, x.device, run, q, check)
    run(config)
    return y


def int8_linear_ref_epilogue(y, scale, bias, activation):
    # K == 0: the product is zero and only the epilogue remains (kept out of the kernel).
    acc = torch.zeros(y.shape, dtype=torch.float32, device=y.device) * scale
    if bias is not None:
        acc = acc + bias.float()
    if activation == "gelu_tanh":
        acc = torch.nn.functional.gelu(acc, approximate="tanh")
    return y.copy_(acc)


def _launch_bwd(dy, T, sb, st, q, scale, dx, M, N, KO, cfg: LaunchConfig, f32: bool):
    if cfg.mode == "dequant":
        w = _dequant(q, scale, KO, dy.dtype)
        torch.mm(dy.reshape(M, N), w, out=dx.view(M, KO))
        return
    per, split = _k_split(N, cfg)
    ws = torch.empty((split, M, KO), dtype=torch.float32, device=dy.device) if split > 1 else _dummy(dy.device)
    grid = (_cdiv(KO, cfg.block_o) * _cdiv(M, cfg.block_m), split)
    args = (dy, q, scale, dx, ws, M, N, KO, T, sb, st, dy.stride(-1), q.stride(0), per)
    common = dict(BLOCK_O=cfg.block_o, BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, GROUP=8, EVEN_R=(N % per == 0),
                  EVEN_O=(KO % cfg.block_o == 0), F32=f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    w8a16._bwd_kernel[grid](*args, TRANS_LOAD=bool(cfg.variant), FAST_CVT=not f32, **common)
    if split > 1:
        mn = M * KO
        w8a16._bwd_reduce_kernel[(_cdiv(mn, _REDUCE_BLOCK),)](ws, dx, mn, split, BLOCK=_REDUCE_BLOCK, num_warps=4)


def int8_linear_grad_input_triton(dy, qweight, scale, k=None, *, config: LaunchConfig | None = None):
    """Triton grad-input: dx = (dy * scale) @ q[:, :k]."""
    what = "int8_linear_grad_input"
    _check_act(dy, what, "dy")
    k = qweight.shape[1] if k is None else int(k)
    if k < 0:
        raise ValueError(f"{what}: k must be >= 0, got {k}")
    q, scale, _ = _check_weight(qweight, scale, None, k, what, dy.device)
    N = q.shape[0]
    if dy.shape[-1] != N:
        raise ValueError(f"{what}: dy has {dy.shape[-1]} features, qweight has {N} rows")
    lead = dy.shape[:-1]
    dx = torch.empty((*lead, k), dtype=dy.dtype, device=dy.device)
    if dx.numel() == 0:
        return dx
    if N == 0:
        return dx.zero_()
    dy2, M, T, sb, st = _rows(dy)
    f32 = _interpreting() or dy.dtype == torch.float32

    def run(cfg, w=q):
        _launch_bwd(dy2, T, sb, st, w, scale, dx, M, N, k, cfg, f32)

    def check(cfg):
        def ref(rows, cols):
            a, b = dy.reshape(M, N)[rows].float() * scale, q[:, cols].float()
            return a @ b, a.abs() @ b.abs()

        return tune.sample_check(dx, ref, k, M)

    if config is None:
        key = ("bwd", dy.device, tune.bucket(M), N, k, dy.dtype)
        config = tune.pick("bwd", key, M, k, N, dy.device, run, q, check)
    run(config)
    return dx
