"""Host (CPU) cost per W8A16 call, against cuBLAS BF16, and where it goes.

Rows: cuBLAS; the W8A16 call as a compiled block makes it after its first call
(a replay of the recorded launch, kernels/launch_memo.py); the same call through
the full path (arguments checked, config looked up, Triton's jit binding: what
every call cost before the replay existed); and the `stagehand::linear` op on a
slot, which is what a compiled graph calls (dispatcher, layout, views, replay).

    python benches/host_overhead.py [--out benches/results/host_overhead.json] [--calls 2000]

At decode-like token counts a kernel runs for ~10 us; if the host needs longer
to issue it, the GPU idles between launches (an eager forward of a model is a
chain of such calls). For each op at M=16 this times n back-to-back calls
(wall clock, synchronised at both ends; the GPU time per call is far below it),
then profiles the same calls with cProfile and prints the functions with the
most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, env_info, host_us_per_call, print_header, print_table, write_json  # noqa: E402


def top_functions(fn, calls, n=12):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append(dict(function=f"{os.path.basename(path)}:{line}:{name}", calls_per_op=nc / calls,
                         own_us_per_op=tt / calls * 1e6, cum_us_per_op=ct / calls * 1e6))
    rows.sort(key=lambda r: -r["own_us_per_op"])
    return rows[:n]


def _slot(q, s):
    """A device slot holding one INT8 layer (weight, then its scale), as the streamer fills it, and its layout."""
    import torch

    import torch_stagehand.runtime.ops  # noqa: F401  (registers torch.ops.stagehand)
    from torch_stagehand.runtime.precision import INT8, LayerLayout, align, get

    n, k = q.shape
    scale_at = align(n * k)
    slot = torch.zeros(align(scale_at + 4 * n), dtype=torch.uint8, device=q.device)
    slot[: n * k].copy_(q.reshape(-1).view(torch.uint8))
    slot[scale_at : scale_at + 4 * n].copy_(s.float().reshape(-1).view(torch.uint8))
    lay = LayerLayout(get(INT8).code, 0, n, k, scale_at, False, 3)
    return slot, lay.as_ints()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "host_overhead.json"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--k", type=int, default=3072)
    ap.add_argument("--n", type=int, default=3072)
    args = ap.parse_args()
    import torch

    from torch_stagehand import kernels as K

    if not torch.cuda.is_available():
        sys.exit("benches/host_overhead.py needs a CUDA device")
    info = env_info()
    print_header(info)
    m, k, n = args.m, args.k, args.n
    x = torch.randn(m, k, device="cuda").bfloat16()
    dy = torch.randn(m, n, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    q, s = K.quantize_per_row(w.float(), "absmax")
    for fn in (lambda: K.int8_linear(x, q, s), lambda: K.int8_linear_grad_input(dy, q, s)):
        fn()  # autotune outside the timing
    from torch_stagehand.kernels.tuning.autotune import bucket

    fwd_cfg = K.tuned_configs()[("fwd", x.device, bucket(m), n, k, x.dtype)]
    bwd_cfg = K.tuned_configs()[("bwd", x.device, bucket(m), n, k, x.dtype)]
    slot, layout = _slot(q, s)
    tok = torch.tensor(0)
    op = torch.ops.stagehand
    ops = {
        "cuBLAS x @ w.T": lambda: x @ w.t(),
        "int8_linear": lambda: K.int8_linear(x, q, s),
        "int8_linear (full path)": lambda: K.int8_linear_triton(x, q, s, config=fwd_cfg),
        "stagehand.linear op (int8)": lambda: op.linear.default(x, slot, None, tok, tok, layout),
        "cuBLAS dy @ w": lambda: dy @ w,
        "int8_linear_grad_input": lambda: K.int8_linear_grad_input(dy, q, s),
        "int8_linear_grad_input (full path)": lambda: K.int8_linear_grad_input_triton(dy, q, s, config=bwd_cfg),
        "stagehand.linear_grad_input op (int8)": lambda: op.linear_grad_input.default(dy, slot, layout),
    }
    for fn in ops.values():
        fn()
    rows, profiles = [], {}
    for name, fn in ops.items():
        rows.append(dict(op=name, host_us_per_call=host_us_per_call(fn, args.calls)))
        if not name.startswith("cuBLAS"):
            profiles[name] = top_functions(fn, args.calls)
    for r in rows:  # each row against the cuBLAS call of its direction
        base = next(b for b in rows if b["op"] == ("cuBLAS dy @ w" if "grad_input" in r["op"] else "cuBLAS x @ w.T"))
        r["vs_cuBLAS"] = r["host_us_per_call"] / base["host_us_per_call"]
    print_table(rows, title=f"host time per call, M={m} K={k} N={n} ({args.calls} back-to-back calls)", floatfmt=".1f")
    for name, prof in profiles.items():
        print_table(prof, title=f"{name}: own time per call (cProfile)", floatfmt=".2f")
    print("chosen configs:", {str(key): str(cfg) for key, cfg in K.tuned_configs().items()})
    write_json(args.out, dict(env=info, shape=dict(m=m, k=k, n=n), rows=rows, profiles=profiles))


if __name__ == "__main__":
    main()
