"""Launchers for the W8A16 Triton kernels (the CPU interpreter included): checks, views, launches with the
config of kernels/tuning/autotune.py unless the caller passes one."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from torch_stagehand.kernels import w8a16
from torch_stagehand.kernels.launch_memo import Executor, LaunchMemo, tensor_key
from torch_stagehand.kernels.reference import check_weight, int8_linear_grad_input_ref, int8_linear_ref
from torch_stagehand.kernels.tuning import autotune as tune, deferral as tune_deferral
from torch_stagehand.kernels.tuning.autotune import LaunchConfig, interpreting

_ACTS = {None: 0, "gelu_tanh": 1}
_REDUCE_BLOCK = 1024
FWD_MEMO, BWD_MEMO = LaunchMemo("int8_linear"), LaunchMemo("int8_linear_grad_input")  # launch_memo.py


def clear_launch_memo() -> None:
    FWD_MEMO.clear()
    BWD_MEMO.clear()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: a constexpr_function, microseconds per host-side call


def _rows(t: torch.Tensor):
    """Collapse t's leading dims to (B, T) strided rows, m = b * T + t, copying only if impossible: (t, M, T,
    stride_b, stride_t)."""
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
    check_weight(qweight, scale, n_in, what, bias)
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


@functools.lru_cache(maxsize=None)
def _dummy(device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=device)  # an unsplit launch's workspace: never touched


def _k_split(red: int, cfg: LaunchConfig):
    """Reduction elements per split (a multiple of block_r) and the splits actually used."""
    per = _cdiv(_cdiv(red, cfg.split), cfg.block_r) * cfg.block_r
    return per, _cdiv(red, per)


def _dequant(ex: Executor, q, scale, k, dtype):
    """bf16/fp16 copy of q[:, :k] * scale (the dequantize + cuBLAS mode), as the call's buffer "w"."""
    n = q.shape[0]
    w = ex.buffer("w", (n, k), dtype, q.device)
    ex.kernel(w8a16._dequant_kernel, (_cdiv(n, 32), _cdiv(k, 256)),
              q, scale, w, n, k, q.stride(0), BLOCK_N=32, BLOCK_K=256, num_warps=4)


def compile_provisional(device: torch.device, dtype: torch.dtype) -> bool:
    """Compile and load the dequantize kernel of `tune.provisional_config` (a cold step's first Triton kernel) by a
    tiny launch with a real call's specialization. False where no compiled kernel runs (CPU, interpreter, fp32)."""
    if device.type != "cuda" or interpreting() or dtype not in (torch.bfloat16, torch.float16):
        return False
    with torch.cuda.device(device):
        q = torch.zeros((32, 256), dtype=torch.int8, device=device)
        _dequant(Executor({}, record=False), q, torch.ones(32, device=device), 256, dtype)
        torch.cuda.synchronize(device)
    return True


def _launch_fwd(ex: Executor, T, sb, st, M, N, K, act, cfg: LaunchConfig, f32: bool):
    t = ex.tensors
    x, q, scale, bias, y = t["x"], t["q"], t["scale"], t.get("bias"), t["y"]
    has_bias = bias is not None
    if cfg.mode == "dequant":
        _dequant(ex, q, scale, K, x.dtype)

        def gemm(t):
            x2d, y2d = t["x"].reshape(M, K), t["y"].view(M, N)  # reshape copies only a non-collapsible x
            if has_bias:
                torch.addmm(t["bias"].to(x2d.dtype), x2d, t["w"].t(), out=y2d)
            else:
                torch.mm(x2d, t["w"].t(), out=y2d)
            if act == 1:
                y2d.copy_(F.gelu(y2d.float(), approximate="tanh"))

        ex.torch(gemm)
        return
    per, split = _k_split(K, cfg)
    if cfg.variant and split > 1:
        raise ValueError(f"int8_linear: config {cfg} scales in registers, which a split launch cannot")
    ws = ex.buffer("ws", (split, M, N), torch.float32, x.device) if split > 1 else _dummy(x.device)
    grid = (_cdiv(N, cfg.block_o) * _cdiv(M, cfg.block_m), split)
    args = (x, q, scale, bias if has_bias else scale, y, ws, M, N, K, T, sb, st, x.stride(-1), q.stride(0), per)
    common = dict(BLOCK_N=cfg.block_o, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_r, GROUP=8, EVEN_K=(K % per == 0),
                  HAS_BIAS=has_bias, ACT=act, F32=f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ex.kernel(w8a16._fwd_kernel, grid, *args, SCALE_A=bool(cfg.variant), **common)
    if split > 1:
        mn = M * N
        ex.kernel(w8a16._fwd_reduce_kernel, (_cdiv(mn, _REDUCE_BLOCK),),
                  ws, scale, bias if has_bias else scale, y, mn, N, split,
                  BLOCK=_REDUCE_BLOCK, HAS_BIAS=has_bias, ACT=act, num_warps=4)


def _compile_only(ex: Executor) -> Executor:
    return Executor(dict(ex.tensors), record=False, compile_only=True)


def _copied_nothing(pairs) -> bool:
    """Did the checks leave every (checked, given) tensor where the caller had it? Only then is the call recorded."""
    return all(a is None or a.data_ptr() == b.data_ptr() for a, b in pairs)


def int8_linear_triton(x, qweight, scale, bias=None, activation=None, *, config: LaunchConfig | None = None):
    """Triton W8A16 forward: y = (x @ q[:, :K].T) * scale + bias, optional tanh-GeLU."""
    what = "int8_linear"
    memo = config is None and FWD_MEMO.enabled(interpreting())
    if memo:
        key = (tensor_key(x), tensor_key(qweight), tensor_key(scale), tensor_key(bias), activation)
        replay = FWD_MEMO.get(key)
        if replay is not None:
            return replay(dict(x=x, q=qweight, scale=scale, bias=bias))["y"]
    _check_act(x, what, "x")
    if activation not in _ACTS:
        raise ValueError(f"{what}: unknown activation {activation!r} (supported: 'gelu_tanh')")
    K = x.shape[-1]
    given = (qweight, scale, bias)
    q, scale, bias = _check_weight(qweight, scale, bias, K, what, x.device)
    N = q.shape[0]
    lead = x.shape[:-1]
    if K == 0 or x.numel() == 0 or N == 0:  # nothing to launch: at K == 0 only the epilogue remains
        return int8_linear_ref(x, q, scale, bias, activation)
    x2, M, T, sb, st = _rows(x)
    memo = memo and x2 is x and _copied_nothing(zip((q, scale, bias), given))
    ex = Executor(dict(x=x2, q=q, scale=scale, bias=bias), record=memo, constants=(_dummy(x.device),))
    y = ex.buffer("y", (*lead, N), x.dtype, x.device)
    f32 = interpreting() or x.dtype == torch.float32
    act = _ACTS[activation]

    def run(cfg, w=q, executor=None):
        executor = executor or Executor(dict(ex.tensors, q=w), record=False)
        _launch_fwd(executor, T, sb, st, M, N, K, act, cfg, f32)

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
        tune_key = ("fwd", x.device, tune.bucket(M), N, K, x.dtype)
        config = tune.pick("fwd", tune_key, M, N, K, x.device, run, q, check,
                           precompile=lambda cfg: run(cfg, executor=_compile_only(ex)),
                           later=lambda: _forward_on_stand_ins(M, N, K, x.dtype, x.device, bias is not None,
                                                               activation))
        if tune_deferral.provisional(tune_key):  # tune.provisional_config for now: not kept for replay
            memo = False
            tune.tune_later(("bwd", x.device, tune.bucket(M), N, K, x.dtype),
                            lambda: _grad_input_on_stand_ins(M, N, K, x.dtype, x.device))
    run(config, executor=ex)
    if memo:
        FWD_MEMO.add(key, ex, x.device)
    return y


def _stand_in_weight(N: int, K: int, device):
    """A random weight as the slots hold it: int8 rows, a float32 scale each."""
    return (torch.randint(-127, 128, (N, K), dtype=torch.int8, device=device),
            torch.rand(N, dtype=torch.float32, device=device) * 1e-2 + 1e-3)


def _forward_on_stand_ins(M: int, N: int, K: int, dtype, device, has_bias: bool, activation) -> None:
    """A forward call on random tensors of these shapes: tunes its key after the caller's tensors are gone."""
    bias = torch.randn(N, dtype=dtype, device=device) if has_bias else None
    int8_linear_triton(torch.randn(M, K, dtype=dtype, device=device), *_stand_in_weight(N, K, device), bias,
                       activation)


def _grad_input_on_stand_ins(M: int, N: int, K: int, dtype, device) -> None:
    """The grad-input call of the same layer on random tensors (the key a backward asks for next)."""
    int8_linear_grad_input_triton(torch.randn(M, N, dtype=dtype, device=device), *_stand_in_weight(N, K, device), K)


def _launch_bwd(ex: Executor, T, sb, st, M, N, KO, cfg: LaunchConfig, f32: bool):
    t = ex.tensors
    dy, q, scale, dx = t["dy"], t["q"], t["scale"], t["dx"]
    if cfg.mode == "dequant":
        _dequant(ex, q, scale, KO, dy.dtype)
        ex.torch(lambda t: torch.mm(t["dy"].reshape(M, N), t["w"], out=t["dx"].view(M, KO)))
        return
    per, split = _k_split(N, cfg)
    ws = ex.buffer("ws", (split, M, KO), torch.float32, dy.device) if split > 1 else _dummy(dy.device)
    grid = (_cdiv(KO, cfg.block_o) * _cdiv(M, cfg.block_m), split)
    args = (dy, q, scale, dx, ws, M, N, KO, T, sb, st, dy.stride(-1), q.stride(0), per)
    common = dict(BLOCK_O=cfg.block_o, BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, GROUP=8, EVEN_R=(N % per == 0),
                  EVEN_O=(KO % cfg.block_o == 0), F32=f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ex.kernel(w8a16._bwd_kernel, grid, *args, TRANS_LOAD=bool(cfg.variant), FAST_CVT=not f32, **common)
    if split > 1:
        mn = M * KO
        ex.kernel(w8a16._bwd_reduce_kernel, (_cdiv(mn, _REDUCE_BLOCK),), ws, dx, mn, split,
                  BLOCK=_REDUCE_BLOCK, num_warps=4)


def int8_linear_grad_input_triton(dy, qweight, scale, k=None, *, config: LaunchConfig | None = None):
    """Triton grad-input: dx = (dy * scale) @ q[:, :k]."""
    what = "int8_linear_grad_input"
    memo = config is None and BWD_MEMO.enabled(interpreting())
    if memo:
        key = (tensor_key(dy), tensor_key(qweight), tensor_key(scale), k)
        replay = BWD_MEMO.get(key)
        if replay is not None:
            return replay(dict(dy=dy, q=qweight, scale=scale))["dx"]
    _check_act(dy, what, "dy")
    k = qweight.shape[1] if k is None else int(k)
    if k < 0:
        raise ValueError(f"{what}: k must be >= 0, got {k}")
    given = (qweight, scale)
    q, scale, _ = _check_weight(qweight, scale, None, k, what, dy.device)
    N = q.shape[0]
    if dy.shape[-1] != N:
        raise ValueError(f"{what}: dy has {dy.shape[-1]} features, qweight has {N} rows")
    lead = dy.shape[:-1]
    if dy.numel() == 0 or k == 0 or N == 0:  # nothing to launch: zeros
        return int8_linear_grad_input_ref(dy, q, scale, k)
    dy2, M, T, sb, st = _rows(dy)
    memo = memo and dy2 is dy and _copied_nothing(zip((q, scale), given))
    ex = Executor(dict(dy=dy2, q=q, scale=scale), record=memo, constants=(_dummy(dy.device),))
    dx = ex.buffer("dx", (*lead, k), dy.dtype, dy.device)
    f32 = interpreting() or dy.dtype == torch.float32

    def run(cfg, w=q, executor=None):
        executor = executor or Executor(dict(ex.tensors, q=w), record=False)
        _launch_bwd(executor, T, sb, st, M, N, k, cfg, f32)

    def check(cfg):
        def ref(rows, cols):
            a, b = dy.reshape(M, N)[rows].float() * scale, q[:, cols].float()
            return a @ b, a.abs() @ b.abs()

        return tune.sample_check(dx, ref, k, M)

    if config is None:
        tune_key = ("bwd", dy.device, tune.bucket(M), N, k, dy.dtype)
        config = tune.pick("bwd", tune_key, M, k, N, dy.device, run, q, check,
                           precompile=lambda cfg: run(cfg, executor=_compile_only(ex)))
    run(config, executor=ex)
    if memo:
        BWD_MEMO.add(key, ex, dy.device)
    return dx
