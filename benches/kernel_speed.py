"""W8A16 kernels against cuBLAS BF16 on the GPU (forward and grad-input).

    python benches/kernel_speed.py [--out benches/results/kernels.json] [--workers 14]

For M in {16, 256, 4096} and (K, N) in {(3072, 3072), (3072, 12288),
(12288, 3072), (4096, 4096)}, in one run: cuBLAS BF16 with the weight already
BF16 on the GPU (`x @ w.T`, `dy @ w`), our autotuned int8_linear /
int8_linear_grad_input, `torch._weight_int8pack_mm` where it runs, torchao's
int8 weight-only if importable, and dequantize + cuBLAS (what a non-fused INT8
path costs). Every time is GPU time from CUDA-graph replays that cycle over
copies of the weight totalling more than twice the L2 (tune.graph_time):
weights arrive cold, as streamed weights do, and host launch gaps are excluded
(the host cost is its own column at M=16, and benches/host_overhead.py).
ratio = cuBLAS BF16 time / ours. At M=16 the table gives achieved
HBM GB/s against the device-to-device copy bandwidth measured in the same run;
at M=4096, TFLOP/s. Every kernel output is checked against its torch twin
before it is timed.

It times every candidate of every regime (STAGEHAND_TUNE_EVERY=1: the table the tuner's
shortlists were drawn from, tune._SHORTLIST). Compiling all autotuning candidates serially takes
minutes, so --workers
processes compile them into Triton's on-disk cache first; the timing process
then loads them from the cache (no timing happens while workers run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, env_info, host_us_per_call, print_header, print_table, write_json  # noqa: E402

SHAPES = [(3072, 3072), (3072, 12288), (12288, 3072), (4096, 4096)]  # (K, N)
MS = [16, 256, 4096]
TARGETS = {("fwd", 16): 1.6, ("fwd", 256): 1.0, ("fwd", 4096): 0.9, ("bwd", 4096): 0.85}


def _tensors(m, k, n, seed=0):
    import torch

    from torch_stagehand.kernels import quantize_per_row

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    dy = torch.randn(m, n, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    q, s = quantize_per_row(w.float(), "absmax")
    return x, dy, w, q, s


def _precompile_job(job):
    """Worker: run every candidate of one (kind, M, tile) once on every shape (compiles it)."""
    import torch

    from torch_stagehand.kernels.launch import int8_linear_grad_input_triton, int8_linear_triton
    from torch_stagehand.kernels.tuning.autotune import candidates, tiles

    kind, m, tile = job
    dev = torch.device("cuda")
    n_ok = 0
    for k, n in SHAPES:
        x, dy, w, q, s = _tensors(m, k, n)
        red, n_out = (k, n) if kind == "fwd" else (n, k)
        for cfg in candidates(kind, m, n_out, red, dev):
            if cfg.mode != "fused" or (cfg.block_o, cfg.block_m, cfg.block_r) != tiles(m, kind)[tile][:3]:
                continue
            try:
                if kind == "fwd":
                    int8_linear_triton(x, q, s, config=cfg)
                else:
                    int8_linear_grad_input_triton(dy, q, s, config=cfg)
                n_ok += 1
            except Exception:  # noqa: BLE001 - the tuner skips it the same way
                pass
    torch.cuda.synchronize()
    return n_ok


def precompile(workers: int):
    import multiprocessing as mp

    from torch_stagehand.kernels.tuning.autotune import tiles

    jobs = [(kind, m, t) for kind in ("bwd", "fwd") for m in MS for t in range(len(tiles(m, kind)))]
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map(_precompile_job, jobs, chunksize=1))
    print(f"precompiled {done} launches over {len(jobs)} jobs in {time.time() - t0:.0f}s", flush=True)


def _bench(fn, rep):
    import triton

    return triton.testing.do_bench(fn, warmup=max(rep // 4, 5), rep=rep, return_mode="median")


def copy_bandwidth(rep):
    import torch

    a = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    t = _bench(lambda: b.copy_(a), rep)
    return 2 * 2 * 2**30 / (t * 1e-3) / 1e9  # read + write


def _torchao_linear(w):
    """torchao's int8 weight-only Linear for w, or None where torchao is not installed."""
    try:
        import torch
        from torchao.quantization import int8_weight_only, quantize_
    except Exception:  # noqa: BLE001 - not on the device machines: skipped, the table says n/a
        return None
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.weight.data.copy_(w)
    quantize_(lin, int8_weight_only())
    return lin


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run(args):
    import torch

    import torch_stagehand.kernels as K
    from torch_stagehand.kernels.tuning.autotune import _rotating_copies, graph_time

    info = print_header(env_info())
    bw = copy_bandwidth(args.rep)
    print(f"device-to-device copy: {bw:.0f} GB/s (read + write)", flush=True)
    rows, checks, rejected = [], [], {}
    for k, n in SHAPES:
        for m in MS:
            x, dy, w, q, s = _tensors(m, k, n, seed=m + k + n)
            # correctness first (this call also autotunes)
            y = K.int8_linear(x, q, s)
            dx = K.int8_linear_grad_input(dy, q, s)
            checks.append(dict(m=m, k=k, n=n, fwd_rel=_rel(y, K.int8_linear_ref(x, q, s)),
                               bwd_rel=_rel(dx, K.int8_linear_grad_input_ref(dy, q, s))))
            qs, ws, s_bf = _rotating_copies(q), _rotating_copies(w), s.bfloat16()
            # (weight-taking callables: each method streams its own rotating weight copies)
            fwd = {
                "cublas_bf16": (lambda ww: x @ ww.t(), ws),
                "stagehand_int8": (lambda qq: K.int8_linear(x, qq, s), qs),
            }
            if hasattr(torch, "_weight_int8pack_mm") and m <= 16:  # a slow fallback on CUDA: small M only
                fwd["torch_int8pack_mm"] = (lambda qq: torch._weight_int8pack_mm(x, qq, s_bf), qs)
            ao = _torchao_linear(w)
            if ao is not None:
                fwd["torchao_int8wo"] = (lambda ww: ao(x), ws[:1])
            bwd = {
                "cublas_bf16": (lambda ww: dy @ ww, ws),
                "stagehand_int8": (lambda qq: K.int8_linear_grad_input(dy, qq, s), qs),
            }
            log = K.tuning_log()
            for kind, fns in (("fwd", fwd), ("bwd", bwd)):
                times = {}
                for name, (fn, weights) in fns.items():
                    try:
                        times[name] = graph_time(fn, weights)
                    except Exception as e:  # noqa: BLE001 - e.g. no CUDA kernel for int8pack_mm
                        times[name] = None
                        print(f"  {kind} {name} m={m} k={k} n={n}: unavailable ({type(e).__name__}: {str(e)[:80]})")
                ours, base = times["stagehand_int8"], times["cublas_bf16"]
                key = next(kk for kk in log if kk[0] == kind and kk[2] == K.tune.bucket(m)
                           and kk[3:5] == (n, k))  # both keys hold (N, K)
                entry = log[key]
                fused = {c: t for c, t in entry["times_us"].items() if c.mode == "fused"}
                best_fused = min(fused.values()) if fused else None
                best_fused_cfg = str(min(fused, key=fused.get)) if fused else None
                deq = next((t for c, t in entry["times_us"].items() if c.mode == "dequant"), None)
                rejected[f"{kind} M={m} K={k} N={n}"] = {str(c): r for c, r in entry["rejected"].items()}
                flops = 2.0 * m * n * k
                bytes_ours = n * k + 4 * n + 2 * m * (k + n)
                bytes_bf16 = 2 * n * k + 2 * m * (k + n)
                row = dict(
                    kind=kind, M=m, K=k, N=n, chosen=str(entry["chosen"]), best_fused=best_fused_cfg,
                    cublas_us=base * 1e3, ours_us=ours * 1e3, ratio=base / ours,
                    fused_us=best_fused, fused_ratio=None if best_fused is None else base * 1e3 / best_fused,
                    dequant_cublas_us=deq, target=TARGETS.get((kind, m)),
                    ours_GBps=bytes_ours / (ours * 1e-3) / 1e9,
                    cublas_GBps=bytes_bf16 / (base * 1e-3) / 1e9,
                    ours_TFLOPs=flops / (ours * 1e-3) / 1e12,
                    cublas_TFLOPs=flops / (base * 1e-3) / 1e12,
                    rejected=len(entry["rejected"]),
                )
                for name, t in times.items():
                    if name not in ("cublas_bf16", "stagehand_int8"):
                        row[f"{name}_us"] = None if t is None else t * 1e3
                if m == MS[0]:  # at small M the host launch cost can exceed the GPU time
                    row["ours_host_us"] = host_us_per_call(lambda: fns["stagehand_int8"][0](q))
                    row["cublas_host_us"] = host_us_per_call(lambda: fns["cublas_bf16"][0](w))
                rows.append(row)
                print(f"{kind} M={m} K={k} N={n}: cuBLAS {base * 1e3:.1f} us, ours {ours * 1e3:.1f} us "
                      f"({entry['chosen']}), ratio {base / ours:.2f}, best fused {best_fused}, dequant {deq}, "
                      f"rejected {len(entry['rejected'])}", flush=True)
            del qs, ws
    tuned = {str(key[:1] + key[2:]): vars(cfg) for key, cfg in K.tuned_configs().items()}
    # Every timed candidate, so a choice can be checked and a family compared.
    timed = {str(key[:1] + key[2:]): {_short(str(c)): us for c, us in sorted(e["times_us"].items(), key=lambda kv: kv[1])}
             for key, e in K.tuning_log().items()}
    return info, bw, rows, checks, tuned, rejected, timed


def _short(cfg: str) -> str:
    # "LaunchConfig(block_o=64, block_m=16, ..., mode='fused')" -> "64x16x256 s1 w4 st3 v0"
    import re

    if "dequant" in cfg:
        return "dequant+cuBLAS"
    v = dict(re.findall(r"(\w+)=([\w']+)", cfg))
    return f"{v['block_o']}x{v['block_m']}x{v['block_r']} s{v['split']} w{v['num_warps']} st{v['num_stages']} v{v['variant']}"


def summarize(bw, rows, checks, rejected):
    table = []
    for r in rows:
        met = "" if r["target"] is None else ("met" if r["ratio"] >= r["target"] else "MISSED")
        extra = f"{r['ours_GBps']:.0f} GB/s ({100 * r['ours_GBps'] / bw:.0f}%)" if r["M"] == 16 else (
            f"{r['ours_TFLOPs']:.0f} (cuBLAS {r['cublas_TFLOPs']:.0f})" if r["M"] == 4096 else "")
        table.append([r["kind"], r["M"], f"{r['K']}x{r['N']}", r["cublas_us"], r["ours_us"], r["ratio"],
                      r["target"] or "", met, r["fused_us"], r["fused_ratio"], r["dequant_cublas_us"],
                      r.get("torch_int8pack_mm_us", ""), _short(r["chosen"]), r["rejected"], extra])
    print_table([dict(c) for c in checks], title="correctness vs twin (relative error)")
    for key, rej in rejected.items():
        for cfg, reason in rej.items():
            print(f"rejected {key}: {_short(cfg)}: {reason}")
    print(f"torchao: {'benchmarked' if any('torchao_int8wo_us' in r for r in rows) else 'not installed, skipped'}; "
          f"GB/s column: % of the {bw:.0f} GB/s copy bandwidth measured in this run")
    print_table(table, ["op", "M", "KxN", "cuBLAS us", "ours us", "ratio", "target", "", "fused us", "fused ratio",
                        "deq+cuBLAS us", "int8pack us", "chosen", "rej", "M=16 GB/s, M=4096 TFLOP/s"],
                title="W8A16 vs cuBLAS BF16 (GPU time: CUDA-graph replays over rotating weight copies > 2x L2)",
                floatfmt=".2f")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "kernels.json"))
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    ap.add_argument("--rep", type=int, default=100, help="do_bench time for the copy-bandwidth measurement, ms")
    args = ap.parse_args()
    # Every candidate, before the spawned precompile workers start (they inherit it). Not at import: with benches/ on
    # sys.path, transformers finds this file as Hugging Face's `kernels` package and imports it.
    os.environ.setdefault("STAGEHAND_TUNE_EVERY", "1")
    import torch

    if not torch.cuda.is_available():
        sys.exit("benches/kernel_speed.py needs a CUDA device")
    if args.workers > 1:
        precompile(args.workers)
    t0 = time.time()
    info, bw, rows, checks, tuned, rejected, timed = run(args)
    summarize(bw, rows, checks, rejected)
    write_json(args.out, dict(env=info, copy_GBps=bw, rows=rows, checks=checks, tuned=tuned, rejected=rejected,
                              candidates_us=timed,
                              seconds=time.time() - t0, targets={f"{a}@M={b}": v for (a, b), v in TARGETS.items()}))


if __name__ == "__main__":
    main()
