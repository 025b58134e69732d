"""Configs and the autotuner of the W8A16 launches. A candidate is a whole launch sequence (split-K and its
reduction, or dequantize + cuBLAS). Per key the candidates are compiled at once, then each is run, checked against
fp32 (a miscompiled config is rejected) and timed as a CUDA graph over weight copies larger than the L2.
STAGEHAND_AUTOTUNE=0: `heuristic`. Choices are kept on disk."""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
import triton

from torch_stagehand.environment import env
from torch_stagehand.kernels.tuning import cache as tune_cache, deferral


@dataclass(frozen=True)
class LaunchConfig:
    """One launch: output tile (weight rows) x token tile x reduction step, split count. variant 1: the forward
    scales the weight tile in registers, the grad-input loads it [n, o] and transposes. mode "dequant": a Triton
    dequantize, then cuBLAS."""

    block_o: int
    block_m: int
    block_r: int
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3
    variant: int = 0
    mode: str = "fused"


DEQUANT = LaunchConfig(0, 0, 0, mode="dequant")
# fp32 activations (toy models) run the ieee fp32 dot on CUDA cores: a small tile that neither spills nor needs tuning.
F32_CONFIG = LaunchConfig(64, 32, 32, 1, 4, 2)

_SM_COUNT: dict = {}


def interpreting() -> bool:
    return env("TRITON_INTERPRET")


def sms(device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def bucket(m: int) -> int:
    return 1 << max(4, min((m - 1).bit_length(), 12))  # 16, 32, ..., 4096 (and above)


def tiles(m: int, kind: str = "fwd"):
    """Tile shapes (block_o, block_m, block_r, warps, stages) for a token count, the untuned default first: small M
    is bandwidth-bound (deep pipelines, long reduction steps), large M compute-bound (one or two warpgroups)."""
    if m <= 64:
        bm = max(16, bucket(m))
        out = [(64, bm, 128, 4, 4), (64, bm, 256, 4, 3), (128, bm, 128, 4, 4), (128, bm, 256, 8, 3)]
        # 16/32-row weight tiles may fill the SMs without a split (grad-input: 32 only, 16 reads half sectors).
        if kind == "fwd":
            out.append((16, bm, 512 if bm == 16 else 256, 4, 4))
        out.append((32, bm, 256 if bm <= 32 else 128, 4, 4))
        return out
    if m <= 512:
        return [(128, 64, 64, 4, 4), (128, 64, 128, 4, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3),
                (64, 128, 128, 4, 3)]
    # One warpgroup first: the untuned default must be a config seen correct everywhere.
    return [(64, 128, 128, 4, 3), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
            (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3)]


def splits(m: int, n_out: int, red: int, bo: int, bm: int, br: int, n_sm: int):
    """Split counts worth trying: only while the unsplit grid leaves SMs idle."""
    n_tiles = triton.cdiv(n_out, bo) * triton.cdiv(m, bm)
    out = [1]
    for s in (2, 4, 8, 16):
        if n_tiles * (s // 2) < 2 * n_sm and red >= 2 * br * s:
            out.append(s)
    return out


# Per regime, the tiles timed beside its default, with every split (STAGEHAND_TUNE_EVERY=1: all; benches/kernel_speed.py).
_SHORTLIST = {"compute": {(128, 256, 64, 8, 3), (128, 256, 64, 8, 4)},
              "mid": {(128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (64, 128, 128, 4, 3)},
              "bandwidth": {("fwd", 32, 256), ("fwd", 32, 128), ("bwd", 128, 128)}}


def candidates(kind: str, m: int, n_out: int, red: int, device, every: bool | None = None) -> list[LaunchConfig]:
    """The launches the tuner times: the regime's default and shortlist, or every one (`STAGEHAND_TUNE_EVERY`)."""
    n_sm = sms(device)
    every = env("STAGEHAND_TUNE_EVERY") if every is None else every
    regime = tiles(m, kind)
    if not every:  # in the bandwidth regime the token tile follows M: the shortlist names (kind, bo, br)
        short = _SHORTLIST["compute" if m > 512 else "mid" if m > 64 else "bandwidth"]
        regime = [regime[0]] + [t for t in regime[1:] if (t if m > 64 else (kind, t[0], t[2])) in short]
    out = []
    for bo, bm, br, w, st in regime:
        for s in splits(m, n_out, red, bo, bm, br, n_sm):
            # Two-warpgroup forward tiles are miscompiled unless scaled in registers (variant 1), which cannot split.
            if kind != "bwd" and w == 8 and s > 1:
                continue
            variants = ((0, 1) if every else (0,)) if kind == "bwd" else (1,) if w == 8 else (0,)
            out += [LaunchConfig(bo, bm, br, s, w, st, v) for v in variants]
    if m > 512:  # compute-bound: a bf16 copy of the weight costs a few percent
        out.append(DEQUANT)
    return out


def heuristic(kind: str, m: int, n_out: int, red: int, device) -> LaunchConfig:
    """The untuned choice: first tile of the regime, split until the grid fills the SMs."""
    bo, bm, br, w, st = tiles(m, kind)[0]
    opts = splits(m, n_out, red, bo, bm, br, sms(device))
    n_tiles = triton.cdiv(n_out, bo) * triton.cdiv(m, bm)
    s = next((s for s in opts if n_tiles * s >= sms(device)), opts[-1])
    return LaunchConfig(bo, bm, br, s, w, st, 0)


def provisional_config(options: list[LaunchConfig] | None = None) -> LaunchConfig:
    """What a key whose tuning is put off runs: `options`' default, else dequantize + cuBLAS (one Triton kernel
    for every shape: `launch.compile_provisional`)."""
    return options[0] if options else DEQUANT


_LOG: dict[tuple, dict] = {}
_SECONDS = [0.0]  # wall time this process spent tuning (part of a first step)


def tuning_seconds() -> float:
    """Seconds this process has spent autotuning W8A16 launches so far."""
    return _SECONDS[0]


def tuned_configs() -> dict:
    """key -> chosen LaunchConfig, for every key tuned so far."""
    return {k: v["chosen"] for k, v in _LOG.items()}


def tuning_log() -> dict:
    """key -> {chosen, times_us {LaunchConfig: us}, rejected {LaunchConfig: reason}}."""
    return {k: dict(v) for k, v in _LOG.items()}


def tune_later(key, later: Callable[[], None]) -> None:
    """Queue `key` for `tune_deferred` beside a deferred one (a deferred forward's grad-input key), unless tuned."""
    if key not in _LOG:
        deferral.queue(key, later)


def pick(kind, key, m, n_out, red, device, run, weight, check, options: list[LaunchConfig] | None = None,
         precompile=None, later: Callable[[], None] | None = None) -> LaunchConfig:
    """The config for key, tuned once (module docstring). run(cfg, weight) launches; check(cfg) returns None if
    the output is right, else a reason. `options`: another kernel's candidates (grouped.py), its untuned default
    first. `precompile(cfg)`: compiles cfg's kernels only. `later()`: tunes `key` on stand-in tensors; given,
    under `deferral.deferred()` the key runs `provisional_config(options)` for now."""
    if key[-1] == torch.float32 and not interpreting():
        return options[0] if options else F32_CONFIG
    if interpreting() or device.type != "cuda" or not env("STAGEHAND_AUTOTUNE"):
        return options[0] if options else heuristic(kind, m, n_out, red, device)
    if key in _LOG:
        return _LOG[key]["chosen"]
    if torch.cuda.is_current_stream_capturing():  # timing would break the capture
        return options[0] if options else heuristic(kind, m, n_out, red, device)
    deferring = later is not None and deferral.deferring()
    if deferring and deferral.provisional(key):
        return provisional_config(options)
    deferral.drop(key)  # asked outside `deferred()` before its turn came: tuned here and now
    disk = tune_cache.TuneCache.for_device(device) if tune_cache.enabled() else None
    cached = disk.get(key, LaunchConfig) if disk is not None else None
    if cached is not None:
        try:
            run(cached, weight)
            reason = check(cached)
        except Exception as e:  # noqa: BLE001 - a config this build cannot launch: tune again
            reason = f"launch failed: {type(e).__name__}"
        if reason is None:
            _LOG[key] = dict(chosen=cached, times_us={}, rejected={}, from_disk=True)
            return cached
    if deferring:
        deferral.queue(key, later)
        return provisional_config(options)
    started = time.perf_counter()
    configs = options or candidates(kind, m, n_out, red, device)
    if precompile is not None:
        precompile_all(configs, precompile, device)
    compiled_s = time.perf_counter() - started
    weights = _rotating_copies(weight)
    times, rejected = {}, {}
    for cfg in configs:
        try:
            run(cfg, weight)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip, keep the rest
            rejected[cfg] = f"launch failed: {type(e).__name__}"
            continue
        reason = check(cfg)
        if reason is not None:
            rejected[cfg] = reason
            continue
        times[cfg] = graph_time(lambda w, cfg=cfg: run(cfg, w), weights) * 1e3
    del weights
    if not times:
        raise RuntimeError(f"stagehand W8A16 {kind}: no kernel config passed for {key}: {rejected}")
    best = min(times, key=times.get)
    _LOG[key] = dict(chosen=best, times_us=times, rejected=rejected, precompile_s=round(compiled_s, 3),
                     seconds=round(time.perf_counter() - started, 3))
    _SECONDS[0] += time.perf_counter() - started
    if disk is not None:
        disk.put(key, best)
    return best


def precompile_threads() -> int:
    """Threads that compile a key's candidates at once (`STAGEHAND_TUNE_THREADS`; 1: each as it is first run)."""
    return max(1, env("STAGEHAND_TUNE_THREADS"))


def precompile_all(configs: list[LaunchConfig], precompile, device) -> None:
    """Compile every candidate's kernels on `precompile_threads()` threads (mostly outside the GIL) first."""
    threads = min(precompile_threads(), len(configs))
    if threads <= 1:
        return
    yielding = deferral.yielding()

    def one(cfg: LaunchConfig) -> None:
        if yielding:
            deferral.yield_cpu()
        compiled_on(device, lambda: precompile(cfg))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, configs))


def compiled_on(device, compile_fn: Callable[[], None]) -> bool:
    """`compile_fn()` on `device`; False where the compiler rejects it (the timed loop records why)."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        try:
            compile_fn()
            return True
        except Exception:  # noqa: BLE001 - see above
            return False


def _rotating_copies(weight: torch.Tensor, cap: int = 16) -> list[torch.Tensor]:
    l2 = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 50 * 2**20)
    n = max(1, min(cap, math.ceil(2 * l2 / max(weight.numel() * weight.element_size(), 1))))
    return [weight] + [weight.clone() for _ in range(n - 1)]


def rounds_per_replay(round_ms: float, n_weights: int, target_ms: float = 1.0, cap_calls: int = 24) -> int:
    """Rounds over the rotating weights per timed replay: `target_ms` of GPU work, at most `cap_calls` calls."""
    most = max(1, cap_calls // max(1, n_weights))
    return most if round_ms <= 0 else max(1, min(most, math.ceil(target_ms / round_ms)))


def graph_time(fn, weights, replays: int = 5) -> float:
    """Median ms per call of fn(w), w cycling over weights, from CUDA graph replays; do_bench where capture fails."""
    try:
        fn(weights[0])  # warm: lazy handles (cuBLAS workspace) must exist before capture
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def capture(rounds: int) -> torch.cuda.CUDAGraph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(rounds):
                    for w in weights:
                        fn(w)
            g.replay()  # the first replay pays for uploading the graph
            return g

        def timed(g: torch.cuda.CUDAGraph) -> float:
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        g = capture(1)
        rounds = rounds_per_replay(timed(g), len(weights))
        if rounds > 1:
            del g
            g = capture(rounds)
        times = [timed(g) / (rounds * len(weights)) for _ in range(replays)]
        del g
        return sorted(times)[len(times) // 2]
    except Exception:  # noqa: BLE001 - capture unsupported here: time eagerly
        torch.cuda.synchronize()
        return triton.testing.do_bench(lambda: fn(weights[0]), warmup=5, rep=20, return_mode="median")


def sample_check(out: torch.Tensor, ref_fn, n_cols: int, n_rows: int, gen_seed: int = 0):
    """Compare out[rows, cols] (2-D view) with ref_fn(rows, cols) -> (fp32 reference, the same product on absolute
    values) on a random sample; None if right, else why. Tolerance: one bf16 rounding of the output, 2% of the
    sample's RMS, and 2^-7 * magnitude (an element that cancels is judged by what cancelled)."""
    g = torch.Generator().manual_seed(gen_seed)
    cols = torch.randperm(n_cols, generator=g)[:64].to(out.device)
    rows = torch.randperm(n_rows, generator=g)[:256].to(out.device)
    got = out.reshape(n_rows, n_cols)[rows][:, cols].double()
    ref, magnitude = ref_fn(rows, cols)
    ref, magnitude = ref.double(), magnitude.double()
    if not torch.isfinite(got).all():
        return "non-finite output"
    tol = 1e-2 * ref.abs() + 2e-2 * ref.pow(2).mean().sqrt() + 2.0**-7 * magnitude
    bad = (got - ref).abs() > tol
    if bad.any():
        rel = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        return f"wrong: {int(bad.sum())}/{bad.numel()} sampled elements off, rel err {rel:.2e}"
    return None
