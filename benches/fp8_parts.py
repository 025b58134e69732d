"""Where an fp8 Linear's time goes on this GPU, piece by piece, against cuBLAS bf16 (issue 10).

    python benches/fp8_parts.py --out benches/results/fp8_parts_h100.json

Per Linear shape of workload A's block at 4096 tokens, each piece timed on the
GPU alone (captured in a CUDA graph and replayed `--iters` times between two
events, so host issue time is left out), eagerly back to back (host
included, as a step would pay it), and as the host's own time to issue one
call (`host_us`, at `--host-tokens` tokens, where the GPU never makes it wait):

  bf16 fwd / grad-in        F.linear(x, w) / dy @ w (cuBLAS): the baseline
  quant x / quant dy        the per-row E4M3 kernel (kernels/fp8_quant.py)
  transpose q               the column-major weight grad-input needs: torch's copy, the tiled kernel
  mm rowwise [fast]         torch._scaled_mm, row-wise scales, pre-quantized operands
  mm tensorwise [fast]      the same with one scale per operand (cuBLASLt)
  fwd / grad-in (stagehand) runtime/precision/fp8.py's scaled_linear / scaled_grad_input
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from _common import RESULTS, env_info, print_header, print_table, write_json

from torch_stagehand.kernels.fp8_quant import quantize_rows, transpose_bytes
from torch_stagehand.runtime.precision.fp8 import quantize_rows_e4m3, scaled_grad_input, scaled_linear
from torch_stagehand.runtime.selective.fp8_bench import time_back_to_back

SHAPES = [(3072, 3072), (12288, 3072), (3072, 15360)]  # (out, in): q/k/v, proj_mlp, proj_out


def graph_ms(fn, iters: int) -> float:
    """GPU time per call: `iters` calls captured once in a CUDA graph, replayed between events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def eager_ms(fn, iters: int) -> float:
    """Per call with the host issuing each call (back to back): the policy bench's own measure."""
    return time_back_to_back(fn, iters, repeats=1)


def host_us(fn, iters: int = 300) -> float:
    """Host time to issue one call, with GPU work so small that the host never waits on the GPU."""
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - start) / iters * 1e6
    torch.cuda.synchronize()
    return host


def pieces(n: int, k: int, m: int) -> dict:
    dev = torch.device("cuda")
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    q, s = quantize_rows_e4m3(w)
    xq, xs = quantize_rows(x)
    dq, ds = quantize_rows(dy, col_scale=s)
    qt = q.t().contiguous()  # [k, n]: grad-input's column-major second operand is qt.t()
    one = torch.ones((), device=dev)
    ones_k = torch.ones(1, k, device=dev)
    sn = s.view(1, n)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)

    def mm(a, b, sa, sb, fast):
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)

    return {
        "bf16 fwd": lambda: F.linear(x, w),
        "bf16 grad-in": lambda: dy @ w,
        "quant x": lambda: quantize_rows(x),
        "quant dy (col scale)": lambda: quantize_rows(dy, col_scale=s),
        "transpose q (torch)": lambda: q.t().contiguous(),
        "transpose q (kernel)": lambda: transpose_bytes(q),
        "transpose q (kernel, tile 64)": lambda: transpose_bytes(q, tile=64),
        "fwd mm rowwise": lambda: mm(xq, q.t(), xs, sn, False),
        "fwd mm rowwise fast": lambda: mm(xq, q.t(), xs, sn, True),
        "fwd mm rowwise fast + bias": lambda: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=sn, bias=bias,
                                                               out_dtype=torch.bfloat16, use_fast_accum=True),
        "bf16 fwd + bias": lambda: F.linear(x, w, bias),
        "empty x2": lambda: (torch.empty(m, k, device=dev, dtype=torch.float8_e4m3fn),
                             torch.empty(m, 1, device=dev)),
        "fwd mm tensorwise": lambda: mm(xq, q.t(), one, one, False),
        "fwd mm tensorwise fast": lambda: mm(xq, q.t(), one, one, True),
        "grad mm rowwise": lambda: mm(dq, qt.t(), ds, ones_k, False),
        "grad mm rowwise fast": lambda: mm(dq, qt.t(), ds, ones_k, True),
        "grad mm tensorwise fast": lambda: mm(dq, qt.t(), one, one, True),
        "fwd (stagehand)": lambda: scaled_linear(x, q, s, None),
        "fwd + bias (stagehand)": lambda: scaled_linear(x, q, s, bias),
        "quant x, scaled_mm, transpose (host)": lambda: (quantize_rows(x), transpose_bytes(q),
                                                         mm(xq, q.t(), xs, sn, True)),
        "grad-in (stagehand)": lambda: scaled_grad_input(dy, q, s),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--host-tokens", type=int, default=16, help="token count of the host-time column (tiny GPU work)")
    ap.add_argument("--out", default=f"{RESULTS}/fp8_parts.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_parts: needs a CUDA GPU with FP8 tensor cores")
    results = {"env": print_header(env_info()), "tokens": args.tokens, "rows": []}
    for n, k in SHAPES:
        small = pieces(n, k, args.host_tokens)
        for name, fn in pieces(n, k, args.tokens).items():
            row = {"shape": f"{n}x{k}", "piece": name}
            try:  # a piece the library refuses at one of the two token counts is reported, not fatal
                # Eager first: a refusal inside a CUDA graph capture would leave the capture broken.
                row["host_us"] = round(host_us(small[name]), 1)
                row["eager_ms"] = round(eager_ms(fn, args.iters), 4)
                row["gpu_ms"] = round(graph_ms(fn, args.iters), 4)
            except RuntimeError as e:
                row["error"] = str(e).splitlines()[0][:120]
                print(f"  {n}x{k} {name}: {row['error']}", flush=True)
            flops = 2 * n * k * args.tokens
            if "gpu_ms" in row and ("mm" in name or "bf16" in name or "stagehand" in name):
                row["tflops"] = round(flops / row["gpu_ms"] / 1e9, 0)
            results["rows"].append(row)
        torch.cuda.empty_cache()
    print_table(results["rows"], title=f"fp8 pieces at {args.tokens} tokens (out x in)")
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
