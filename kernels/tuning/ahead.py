"""The W8A16 candidates a cold step's tuner will time, compiled ahead into Triton's cache by the ahead-compile
workers: a binary depends on the config, dtypes, flags and 16-divisibility, not the token count, so each candidate
of each INT8 Linear shape and token regime (`REGIME_ROWS`) is compiled on meta tensors and loaded."""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from torch_stagehand.kernels.tuning import autotune as tune
from torch_stagehand.kernels.launch import _k_split, _launch_bwd, _launch_fwd, _rows
from torch_stagehand.kernels.launch_memo import Executor

REGIME_ROWS = (1, 512)  # in the regimes M <= 16 and 64 < M <= 512 (above, compiled blocks dequantize in-graph)


def tuning_shapes(layers, precision: dict[int, str]) -> list[tuple[int, int, bool]]:
    """(out features, in features, has a bias) of each distinct streamed Linear (not a stack) in an INT8 block."""
    shapes = {(lay.out_features, lay.in_features, getattr(lay.module, "bias", None) is not None)
              for lay in layers if precision.get(lay.block) == "int8" and not getattr(lay, "experts", 0)}
    return sorted(shapes)


def candidate_launches(shapes, dtype: torch.dtype, device: torch.device) -> list[Callable[[], None]]:
    """One call per (shape, regime, kind, candidate) compiling its kernels, in a fixed order (workers split it)."""
    out = []
    for n, k, bias in shapes:
        for m in REGIME_ROWS:
            out += [functools.partial(_compile_forward, m, n, k, bias, dtype, device, cfg)
                    for cfg in regime_configs("fwd", m, n, k, device)]
            out += [functools.partial(_compile_grad_input, m, n, k, dtype, device, cfg)
                    for cfg in regime_configs("bwd", m, k, n, device)]
    return out


def regime_configs(kind: str, m: int, n_out: int, red: int, device) -> list[tune.LaunchConfig]:
    """The tuner's candidates for any token count of `m`'s regime, one per binary (a split count changes it only
    through whether the reduction divides evenly)."""
    seen, out = set(), []
    for cfg in tune.candidates(kind, m, n_out, red, device):
        for split in (1, 2, 4, 8, 16):
            if split > 1 and (cfg.mode == "dequant" or (kind == "fwd" and cfg.variant) or
                              red < 2 * cfg.block_r * split):
                continue
            candidate = dataclasses.replace(cfg, split=split)
            binary = (dataclasses.replace(cfg, split=1), red % _k_split(red, candidate)[0] == 0)
            if binary not in seen:
                seen.add(binary)
                out.append(candidate)
    return out


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


class _Compiling(Executor):
    """Compiles a call's kernels without launching them, then loads each (which builds its launcher)."""

    def __init__(self, tensors: dict):
        super().__init__(tensors, record=False, compile_only=True)
        self.compiled: list = []

    def kernel(self, fn, grid: tuple, *args, **kwargs):
        compiled = super().kernel(fn, grid, *args, **kwargs)
        self.compiled.append(compiled)
        return compiled

    def load(self) -> None:
        for compiled in self.compiled:
            init = getattr(compiled, "_init_handles", None)  # a Triton without it: the step builds the launcher
            if init is not None:
                init()


def _compile_forward(m: int, n: int, k: int, bias: bool, dtype, device, cfg) -> None:
    x = _meta((m, k), dtype)
    ex = _Compiling(dict(x=x, q=_meta((n, k), torch.int8), scale=_meta((n,), torch.float32),
                         bias=_meta((n,), dtype) if bias else None))
    ex.buffer("y", (m, n), dtype, x.device)
    _, rows, t, sb, st = _rows(x)
    _launch_fwd(ex, t, sb, st, rows, n, k, 0, cfg, False)  # a streamed Linear's forward: no fused activation
    ex.load()


def _compile_grad_input(m: int, n: int, k: int, dtype, device, cfg) -> None:
    dy = _meta((m, n), dtype)
    ex = _Compiling(dict(dy=dy, q=_meta((n, k), torch.int8), scale=_meta((n,), torch.float32)))
    ex.buffer("dx", (m, k), dtype, dy.device)
    _, rows, t, sb, st = _rows(dy)
    _launch_bwd(ex, t, sb, st, rows, n, k, cfg, False)
    ex.load()


def compile_candidates(launches: list[Callable[[], None]], device: torch.device, threads: int,
                       stop: Callable[[], bool] = lambda: False) -> dict[str, int]:
    """Run `launches` on `threads` threads, a round at a time, until `stop()` (asked between rounds; a failure is
    left to the tuner). Returns how many compiled, failed and were left."""
    done = failed = 0
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for start in range(0, len(launches), max(1, threads)):
            if stop():
                break
            results = list(pool.map(lambda launch: tune.compiled_on(device, launch),
                                    launches[start:start + max(1, threads)]))
            done += sum(results)
            failed += len(results) - sum(results)
    return {"compiled": done, "failed": failed, "left": len(launches) - done - failed}
