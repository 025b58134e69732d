"""Generate the FP8 policy file for this GPU: `python -m torch_stagehand.runtime.selective.fp8_bench --out F`.

Times the bf16 forward + grad-input against the fp8 ones per layer shape (--shapes, out x in) and token count,
and writes the rules (`fp8_rules.rules_from_measurements`)."""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from torch_stagehand.runtime.precision.fp8 import has_fp8_tensor_cores, quantize_rows_e4m3, scaled_grad_input, scaled_linear

from torch_stagehand.runtime.atomic_file import write_atomic
from torch_stagehand.runtime.selective import fp8_rules


def time_back_to_back(fn, iters: int, repeats: int = 5) -> float:
    """Per call, `iters` calls back to back between two events (median of `repeats`): what a step pays when the
    host issues ahead of the GPU (a sync per call would charge launch latency a step never waits for)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def measure(shapes: list[tuple[int, int]], token_counts: list[int], iters: int = 20) -> list[dict]:
    device = torch.device("cuda")
    rows = []
    for n, k in shapes:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        q, s = quantize_rows_e4m3(w)
        for m in token_counts:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            bf16 = time_back_to_back(lambda: (torch.nn.functional.linear(x, w), dy @ w), iters)
            fp8 = time_back_to_back(lambda: (scaled_linear(x, q, s, None), scaled_grad_input(dy, q, s)), iters)
            rows.append({"out_features": n, "in_features": k, "tokens": m, "bf16_ms": round(bf16, 4),
                         "fp8_ms": round(fp8, 4), "speedup": round(bf16 / fp8, 4)})
            print(f"  [{n} x {k}] tokens {m:>6}: bf16 {bf16:.3f} ms  fp8 {fp8:.3f} ms  speedup {bf16 / fp8:.2f}",
                  flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the policy JSON to write")
    ap.add_argument("--shapes", default="3072x3072,12288x3072,3072x12288", help="out x in, comma separated")
    ap.add_argument("--tokens", default="256,1024,4096,16384")
    ap.add_argument("--speedup-threshold", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    if not has_fp8_tensor_cores(device):
        raise SystemExit("fp8_bench: needs a GPU with FP8 tensor cores (compute capability 8.9+)")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = measure(shapes, tokens, args.iters)
    policy = fp8_rules.Fp8Policy(torch.cuda.get_device_name(device), args.speedup_threshold,
                                 fp8_rules.rules_from_measurements(rows, args.speedup_threshold))
    fp8_rules.save(policy, args.out)
    write_atomic(args.out.rsplit(".", 1)[0] + ".measurements.json", json.dumps(rows, indent=1))
    print(f"fp8_bench: {len(policy.rules)} rule(s) for {len(shapes)} shape(s) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
