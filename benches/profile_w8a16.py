"""One W8A16 launch under Nsight Compute, with the config the benchmark chose.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section Occupancy --section MemoryWorkloadAnalysis \
        python benches/profile_w8a16.py --json benches/results/kernels.json --kind fwd --m 16 --k 3072 --n 3072 [--fused]

Reads the chosen config (or, with --fused, the fastest fused one) of that row
of the benchmark's JSON, warms it up, then wraps exactly one call in
cudaProfilerStart/Stop so ncu sees only it (the split-K reduction included).
"""

from __future__ import annotations

import argparse
import json

import torch

from torch_stagehand.kernels import LaunchConfig, int8_linear_grad_input_triton, int8_linear_triton, quantize_per_row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--kind", choices=["fwd", "bwd"], required=True)
    ap.add_argument("--m", type=int, required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--fused", action="store_true", help="the fastest fused config, not the chosen one")
    a = ap.parse_args()
    rows = json.load(open(a.json))["rows"]
    row = next(r for r in rows if (r["kind"], r["M"], r["K"], r["N"]) == (a.kind, a.m, a.k, a.n))
    cfg = eval(row["best_fused"] if a.fused else row["chosen"], {"Config": LaunchConfig, "LaunchConfig": LaunchConfig})  # our own file
    print(f"profiling {a.kind} M={a.m} K={a.k} N={a.n} with {cfg}", flush=True)
    x = torch.randn(a.m, a.k, device="cuda").bfloat16()
    dy = torch.randn(a.m, a.n, device="cuda").bfloat16()
    q, s = quantize_per_row(torch.randn(a.n, a.k, device="cuda") * 0.02, "absmax")

    def call():
        if a.kind == "fwd":
            return int8_linear_triton(x, q, s, config=cfg)
        return int8_linear_grad_input_triton(dy, q, s, config=cfg)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
