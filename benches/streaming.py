"""Streaming a DiT whose block weights live in host memory: step time against resident weights.

    python benches/streaming.py --depth 48 --tokens 1024 4096 --steps 5 --out benches/results/streaming.json

One training step = forward + backward with the block weights frozen (the
embedding trains, so gradients flow back through every block), the LoRA-style
workload. Rows, all measured in the same run on the same model shape:

* resident: the plain model, all weights on the GPU, torch.compile(inductor):
  the speed of the hardware, the baseline the ratio is taken against;
* stagehand bf16 / int8 / mixed: weights streamed from pinned host memory.

Also printed: the H2D floor (the bytes a step must move over the measured
pinned copy bandwidth), the achieved H2D rate, and peak device memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from _common import RESULTS, env_info, print_header, print_table, write_json

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


def run(args) -> dict:
    results = {"env": print_header(env_info()), "rows": []}
    gbps = pinned_h2d_gbps()
    results["pinned_h2d_gbps"] = gbps
    print(f"pinned H2D {gbps:.1f} GB/s", flush=True)
    for tokens in args.tokens:
        model, (x,) = dit(depth=args.depth, tokens=tokens, device="cuda")
        model.embed.requires_grad_(True)
        block_bytes = sum(p.numel() * p.element_size() for n, p in model.blocks[0].named_parameters()
                          if n.endswith("weight") and p.dim() == 2)

        torch._dynamo.reset()
        torch.cuda.reset_peak_memory_stats()
        compiled = torch.compile(model)
        step = step_fn(model, compiled, x)
        time_steps(step, 2)  # compile + warm up
        base, base_host = time_steps(step, args.steps)
        base_ms = median(base)
        rows = [{"tokens": tokens, "mode": "resident (inductor)", "step_ms": base_ms, "host_ms": median(base_host),
                 "ratio": 1.0,
                 "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "h2d_gb_step": 0.0, "floor_ms": 0.0,
                 "sync_fetches": 0}]
        print(f"tokens {tokens}: resident {base_ms:.1f} ms", flush=True)

        rt = stagehand.offload(model, device="cuda")
        torch.cuda.empty_cache()
        modes = [("stagehand bf16", "bf16"), ("stagehand int8", "int8"),
                 ("stagehand mixed", {b: "int8" if b % 2 == 0 else "bf16" for b in range(args.depth)})]
        if has_fp8_tensor_cores(torch.device("cuda")):  # issue 10: fp8 everywhere, and where measured faster
            modes += [("stagehand fp8", "fp8"), ("stagehand fp8 where faster", fp8_where_faster(rt, tokens, x))]
        for mode, precision in modes:
            rt.set_precision(precision)
            torch._dynamo.reset()
            torch.cuda.reset_peak_memory_stats()
            compiled = torch.compile(model, backend="stagehand")
            step = step_fn(model, compiled, x)
            time_steps(step, 2)
            before = rt.stats()
            times, host = time_steps(step, args.steps)
            after = rt.stats()
            ms = median(times)
            h2d = (after["h2d_bytes"] - before["h2d_bytes"]) / args.steps
            rows.append({
                "tokens": tokens, "mode": mode, "step_ms": ms, "host_ms": median(host), "ratio": base_ms / ms,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "h2d_gb_step": h2d / 1e9,
                "floor_ms": h2d / (gbps * 1e9) * 1e3,
                "sync_fetches": (after["sync_fetches"] - before["sync_fetches"]) / args.steps,
            })
            print(f"tokens {tokens}: {mode} {ms:.1f} ms", flush=True)
        results["rows"] += rows
        results.setdefault("block_mib", block_bytes / 2**20)
        rt.close()
        del model, compiled, rt
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
    headers = ["tokens", "mode", "step ms", "host issue ms", "resident/this", "H2D GB/step", "H2D floor ms",
               "sync fetches/step", "peak GiB"]
    table = [[r["tokens"], r["mode"], f"{r['step_ms']:.1f}", f"{r['host_ms']:.1f}", f"{r['ratio']:.2f}",
              f"{r['h2d_gb_step']:.2f}",
              f"{r['floor_ms']:.1f}", f"{r['sync_fetches']:.1f}", f"{r['peak_gib']:.2f}"] for r in results["rows"]]
    env = results["env"]
    print_table(table, headers, title=(
        f"DiT depth {args.depth}, hidden 3072, {results['block_mib']:.1f} MiB BF16 Linear weights per block; "
        f"pinned H2D {results['pinned_h2d_gbps']:.1f} GB/s; {env['device']}, torch {env['torch']}"))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
