"""Streaming a DiT whose block weights live in host memory: step time against resident weights.

    python benches/streaming.py --depth 48 --tokens 1024 4096 --steps 5 --out benches/results/streaming.json

One training step = forward + backward with the block weights frozen (the
embedding trains, so gradients flow back through every block), the LoRA-style
workload. Rows, all measured in the same run on the same model shape:

* resident (inductor): the plain model, all weights on the GPU, under
  torch.compile's default backend and options: the speed of the hardware,
  the baseline that counts (`ratio_inductor`, printed first);
* resident (eager): the same model run eagerly (`ratio_eager`);
* stagehand bf16 / int8 / mixed (and fp8 on an FP8 GPU): weights streamed
  from pinned host memory.

Ratios are step times over the baseline's (`ratio` is the old field, the other
way up: resident (inductor) / this). Also printed: the H2D floor (the bytes a
step must move over the measured pinned copy bandwidth), and peak device
memory allocated and reserved, over the timed steps and over the first step
(the compile) alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from _common import (PEAK_COLUMNS, RATIO_COLUMNS, RATIOS_NOTE, RESULTS, Sync, add_ratios, env_info, first_step,
                     inductor_settings, print_header, print_rows, resident_row, write_json)

import torch_stagehand as stagehand
from torch_stagehand.app.presets import dit
from torch_stagehand.runtime.precision.fp8 import has_fp8_tensor_cores
from torch_stagehand.runtime.selective import fp8_rules
from torch_stagehand.runtime.selective.fp8_bench import measure


def pinned_h2d_gbps(nbytes: int = 256 * 2**20, reps: int = 10) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9


def time_steps(fn, steps: int) -> tuple[list[float], list[float]]:
    """Per step: wall ms (synchronised), and host ms until fn() returned.

    The host figure is when Python finished issuing the step's work: close to the
    wall time means the GPU waited on the host (launch-bound), far below means
    the step was bound by the GPU or the copies."""
    times, host = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times, host


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def step_fn(model, compiled, x):
    def step():
        out = compiled(x)
        out.float().square().mean().backward()
        for p in model.parameters():
            p.grad = None

    return step


def fp8_where_faster(rt, tokens: int, x: torch.Tensor) -> dict[int, str]:
    """The map adaptive-fp8 gives: fp8 for blocks whose every layer shape measured faster than bf16 here."""
    m = x.numel() // x.shape[-1]
    shapes = sorted({(s.out_features, s.in_features) for s in rt.layers})
    policy = fp8_rules.Fp8Policy("here", 1.0, fp8_rules.rules_from_measurements(measure(shapes, [m], iters=10)))
    return {b: "fp8" if policy.block_takes_fp8([(s.out_features, s.in_features) for s in rt.layers if s.block == b], m)
            else "bf16" for b in range(len(rt.blocks))}


def measured_row(mode: str, step, steps: int, sync: Sync, rt=None) -> dict:
    """The program's first step on its own (its compile), one more, then `steps` timed: ms, host ms, peaks."""
    first = first_step(step, sync)
    time_steps(step, 1)
    sync.reset_peak()
    before = rt.stats() if rt is not None else None
    times, host = time_steps(step, steps)
    row = {"mode": mode, "step_ms": median(times), "host_ms": median(host), **sync.peaks(), **first,
           "h2d_gb_step": 0.0, "floor_ms": 0.0, "sync_fetches": 0}
    if rt is not None:
        after = rt.stats()
        row["h2d_gb_step"] = (after["h2d_bytes"] - before["h2d_bytes"]) / steps / 1e9
        row["sync_fetches"] = (after["sync_fetches"] - before["sync_fetches"]) / steps
    return row


def run(args) -> dict:
    results = {"env": print_header(env_info()), "rows": [], "inductor": inductor_settings(),
               "ratios": dict(RATIOS_NOTE, ratio="old field, the other way up: step_ms of resident (inductor) / "
                                                 "this row's step_ms (a speed ratio)")}
    sync = Sync("cuda")
    gbps = pinned_h2d_gbps()
    results["pinned_h2d_gbps"] = gbps
    print(f"pinned H2D {gbps:.1f} GB/s", flush=True)
    for tokens in args.tokens:
        model, (x,) = dit(depth=args.depth, tokens=tokens, device="cuda")
        model.embed.requires_grad_(True)
        block_bytes = sum(p.numel() * p.element_size() for n, p in model.blocks[0].named_parameters()
                          if n.endswith("weight") and p.dim() == 2)

        # the resident baselines: every weight on the GPU, under torch.compile's defaults and eagerly
        baselines = {compiler: dict(resident_row(compiler, model, lambda fn: step_fn(model, fn, x),
                                                 lambda mode, step: measured_row(mode, step, args.steps, sync)),
                                    tokens=tokens)
                     for compiler in ("inductor", "eager")}
        rows = list(baselines.values())
        print(f"tokens {tokens}: resident {baselines['inductor'].get('step_ms')} ms (inductor), "
              f"{baselines['eager'].get('step_ms')} ms (eager)", flush=True)

        rt = stagehand.offload(model, device="cuda")
        torch.cuda.empty_cache()
        modes = [("stagehand bf16", "bf16"), ("stagehand int8", "int8"),
                 ("stagehand mixed", {b: "int8" if b % 2 == 0 else "bf16" for b in range(args.depth)})]
        if has_fp8_tensor_cores(torch.device("cuda")):  # issue 10: fp8 everywhere, and where measured faster
            modes += [("stagehand fp8", "fp8"), ("stagehand fp8 where faster", fp8_where_faster(rt, tokens, x))]
        for mode, precision in modes:
            rt.set_precision(precision)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="stagehand")
            row = dict(measured_row(mode, step_fn(model, compiled, x), args.steps, sync, rt), tokens=tokens)
            row["floor_ms"] = row["h2d_gb_step"] / gbps * 1e3
            rows.append(row)
            print(f"tokens {tokens}: {mode} {row['step_ms']:.1f} ms", flush=True)
        for row in rows:
            add_ratios(row, baselines)
            base = baselines["inductor"].get("step_ms")
            row["ratio"] = base / row["step_ms"] if base and row.get("step_ms") else None
        results["rows"] += rows
        results.setdefault("block_mib", block_bytes / 2**20)
        rt.close()
        del model, compiled, rt
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=48)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(RESULTS, "streaming.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benches/streaming.py needs a CUDA device")
    results = run(args)
    cols = ["tokens", "mode", "step_ms", "host_ms", *RATIO_COLUMNS, "h2d_gb_step", "floor_ms", "sync_fetches",
            *PEAK_COLUMNS, "compile_s", "error"]
    env = results["env"]
    print_rows(results["rows"], cols, title=(
        f"DiT depth {args.depth}, hidden 3072, {results['block_mib']:.1f} MiB BF16 Linear weights per block; "
        f"pinned H2D {results['pinned_h2d_gbps']:.1f} GB/s; {env['device']}, torch {env['torch']}; baselines: "
        f"resident (inductor) = torch.compile's defaults, resident (eager) = run eagerly"))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
