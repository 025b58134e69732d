"""Budget sweep: one VRAM budget in, the plan the runtime picks, measured against the resident model.

    python benches/budget_sweep.py --model qwen --budgets 8 12 16 20 24          # GiB, on the GPU
    python benches/budget_sweep.py --model flux --budgets 12 16 20
    python benches/budget_sweep.py --model qwen --tiny --device cpu              # a smoke test of the bench

Per model (benches/models.py builders: Qwen2.5-7B shape at sequence 2048 with
its checkpointing off, Flux-dev 12B with its checkpointing on; LoRA r=16,
AdamW), in this one process:

1. the resident baseline (everything on the GPU, eager): step time and peak;
   for Qwen also with checkpointing on (the target at 8 GiB is to beat it);
2. `offload(precision="int8")` with no budget: the fixed two-slot plan;
3. one budget set (the largest): two steps under the smallest plan, the
   second measured (calibration: per-block times and activation bytes);
4. per budget: `rt.replan(vram_budget=...)`, one warm-up step (new variants
   compile), then `--steps` measured steps: step time, peak GPU memory
   (max allocated over the measured steps; must be under the budget), H2D
   and D2H GB per step, the plan's counts, predicted vs measured step time.

Table, JSON and a PNG of step time against budget with the resident and the
two-slot plan as reference lines. On the CPU (`--tiny`) budgets are fractions
of the streamed bytes (the budget bounds the device copy of the weights
there) and the run only checks that every stage works.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
from _common import RESULTS, env_info, print_header, print_table, write_json
from models import LORA_TARGETS, Sync, build_flux, build_qwen, loss_of, make_step, profile_step, set_checkpointing

import torch_stagehand as stagehand

GiB = 2**30


def timed(label: str, step, steps: int, sync: Sync, rt=None, warmup: int = 1) -> dict:
    """`warmup` steps, then `steps` timed ones; peak over the timed ones only.

    A new plan takes two: its first step compiles the variants it needs and measures its peak
    against the prediction (a peak over the budget re-plans at that step's end)."""
    for _ in range(warmup):
        step()
    sync()
    sync.reset_peak()
    before = rt.stats() if rt is not None else None
    gc_before = [g["collections"] for g in gc.get_stats()]
    times, host = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    row = {"mode": label, "step_ms": round(statistics.median(times), 1), "host_ms": round(statistics.median(host), 1),
           "steps_ms": [round(t, 1) for t in times], "peak_gib": sync.peak_gib(),
           # Python's garbage collections per step by generation: a full (gen 2) one over a compiled
           # model's heap can stall the host for tens of ms
           "gc_per_step": [round((g["collections"] - b) / steps, 2) for g, b in zip(gc.get_stats(), gc_before)]}
    if rt is not None:
        after = rt.stats()
        row["h2d_gb_step"] = float(f"{(after['h2d_bytes'] - before['h2d_bytes']) / steps / 1e9:.4g}")
        row["d2h_gb_step"] = float(f"{(after['d2h_bytes'] - before['d2h_bytes']) / steps / 1e9:.4g}")
        row["sync_fetches_step"] = (after["sync_fetches"] - before["sync_fetches"]) / steps
    print(f"  {label}: {row['step_ms']} ms (steps {row['steps_ms']}), peak {row['peak_gib']} GiB", flush=True)
    return row


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _measure(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs, ys) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def gpu_lanes(step) -> dict:
    """One step under torch.profiler, as lanes: when the GPU computed, copied H2D / D2H, and sat idle.

    Compute idle time while an H2D copy runs is time spent waiting for weights (the plan's transfer
    model); idle time with no copy running is time the GPU waited for the host to issue work."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels, h2d, d2h = [], [], []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        span = (e.time_range.start / 1e3, e.time_range.end / 1e3)  # ms
        name = e.name.lower()
        if "htod" in name:
            h2d.append(span)
        elif "dtoh" in name:
            d2h.append(span)
        elif "memcpy" not in name and "memset" not in name:  # device-to-device copies and memsets: neither lane
            kernels.append(span)
    compute, copy_in, copy_out = _union(kernels), _union(h2d), _union(d2h)
    if not compute:
        return {}
    start, end = compute[0][0], compute[-1][1]
    idle = _union([(a[1], b[0]) for a, b in zip(compute, compute[1:]) if b[0] > a[1]])
    waiting_on_copy = _measure(_intersect(idle, copy_in))
    return {"gpu_span_ms": round(end - start, 1), "compute_busy_ms": round(_measure(compute), 1),
            "h2d_busy_ms": round(_measure(copy_in), 1), "d2h_busy_ms": round(_measure(copy_out), 1),
            "compute_idle_ms": round(_measure(idle), 1), "idle_while_h2d_ms": round(waiting_on_copy, 1),
            "idle_no_copy_ms": round(_measure(idle) - waiting_on_copy, 1)}


def host_profile(step, sync, rows: int = 30) -> str:
    """One step under cProfile: the Python functions by own time and by cumulative time (what the host spends
    issuing the step; the GPU runs behind it)."""
    import cProfile
    import io
    import pstats

    sync()
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    sync()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumtime").print_stats(rows + 20)
    out = "\n".join(line[:200] for line in text.getvalue().splitlines() if line.strip())
    print(out, flush=True)
    return out


def profiles(step, sync) -> dict:
    """GPU op table and host profile of one step each (`--profile-budgets`)."""
    return {"ops": profile_step(step), "host": host_profile(step, sync)}


def cost_model_record(rt) -> dict:
    """The planner's cost model for the JSON: per-block seconds in ms (GPU, host), the rest as it is."""
    model = vars(rt.planner.cost_model)
    ms = lambda values: None if values is None else [round(v * 1e3, 3) for v in values]  # noqa: E731
    record = {k: v for k, v in model.items() if k not in ("forward_s", "backward_s", "host_s")}
    record.update(forward_ms=ms(model["forward_s"]), backward_ms=ms(model["backward_s"]),
                  host_ms={kind: ms(v) for kind, v in (model["host_s"] or {}).items()})
    return record


def plan_columns(rt) -> dict:
    plan = rt.plan
    counts = plan.counts()
    return {"plan": plan.kind, "resident": counts["resident_blocks"], "streamed": counts["streamed_blocks"],
            "recomputed": counts["recomputed_blocks"], "spilled": counts["spilled_blocks"], "slots": plan.slots,
            "lookahead": plan.lookahead, "predicted_ms": round(plan.predicted_step_s * 1e3, 1),
            "predicted_peak_gib": round(plan.predicted_peak_bytes / GiB, 2), "over_soft_cap": plan.over_soft_cap}


def run(args) -> dict:
    import peft

    device, sync = args.device, Sync(args.device)
    env = print_header(env_info())
    results: dict = {"env": env, "model": args.model, "tiny": args.tiny, "rows": []}
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11's cuDNN SDPA backward faults at Flux's shape
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, inputs, shape = (build_flux if args.model == "flux" else build_qwen)(args.tiny, device)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS[args.model]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ckpt = args.model == "flux"  # the set-ups: Qwen without checkpointing, Flux with
    results.update(shape=shape, build_s=round(time.perf_counter() - t0, 1), ckpt=ckpt)
    rows = results["rows"]

    def step_of(fn):
        return make_step(args.model, model, fn, inputs, optimizer)

    refs = {}
    with_ckpt_ref = args.model == "qwen" and not args.skip_ckpt_ref
    for label, on in [("resident", ckpt)] + ([("resident ckpt", True)] if with_ckpt_ref else []):
        set_checkpointing(args.model, model, on)
        try:
            refs[label] = timed(label, step_of(model), args.steps, sync)
        except torch.OutOfMemoryError:
            refs[label] = {"mode": label, "error": "out of GPU memory"}
        rows.append(dict(refs[label], ckpt=on))
        if device == "cuda" and label == "resident" and args.profile_budgets and "error" not in refs[label]:
            results.setdefault("profiles", {})[label] = profiles(step_of(model), sync)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    set_checkpointing(args.model, model, ckpt)

    t0 = time.perf_counter()
    rt = stagehand.offload(model, device=device, precision="int8")
    results["offload_s"] = round(time.perf_counter() - t0, 1)
    rt.attach(optimizer)
    streamed = sum(rt.block_nbytes(b, "int8") for b in range(len(rt.blocks)))
    compiled = torch.compile(model, backend="stagehand")
    refs["two-slot"] = dict(timed("two-slot (no budget)", step_of(compiled), args.steps, sync, rt), **plan_columns(rt))
    rows.append(dict(refs["two-slot"], ckpt=ckpt))

    budgets = [(f"{b} GiB", int(b * GiB)) for b in args.budgets] if not args.tiny else \
        [(f"{f:.2f} x weights", int(f * streamed)) for f in args.fractions]
    budgets.sort(key=lambda item: -item[1])
    rt.replan(vram_budget=budgets[0][1])  # calibrate once, under the smallest plan
    for _ in range(2):
        step_of(compiled)()
    sync()
    results["cost_model"] = cost_model_record(rt)  # as calibrated
    base = refs["resident"].get("step_ms")
    for name, nbytes in budgets:
        try:
            rt.replan(vram_budget=nbytes)
        except ValueError as e:  # BudgetError: no plan fits
            rows.append({"mode": f"budget {name}", "budget_gib": round(nbytes / GiB, 3), "error": str(e)[:120]})
            print(f"  budget {name}: {e}", flush=True)
            continue
        row = dict(timed(f"budget {name}", step_of(compiled), args.steps, sync, rt, warmup=2), **plan_columns(rt))
        row["plan_corrections"] = list(rt.stats()["plan_corrections"])
        row.update(budget_gib=round(nbytes / GiB, 6), ckpt=ckpt,
                   pred_err=round(row["predicted_ms"] / row["step_ms"] - 1, 3) if row["step_ms"] else None)
        if row["peak_gib"] is not None:
            row["under_budget"] = row["peak_gib"] <= nbytes / GiB
        if base:
            row["ratio"] = round(row["step_ms"] / base, 3)
        if device == "cuda" and row["budget_gib"] in args.trace_budgets:
            row["gpu_lanes"] = gpu_lanes(step_of(compiled))
            print(f"  budget {name}: GPU lanes {row['gpu_lanes']}", flush=True)
        if device == "cuda" and row["budget_gib"] in args.profile_budgets:
            results.setdefault("profiles", {})[f"budget {name}"] = profiles(step_of(compiled), sync)
        rows.append(row)
        write_json(args.out, results)  # after every budget: a run cut off by a time limit keeps what it measured
    results["cost_model_final"] = cost_model_record(rt)  # as the plans' first steps refined it
    results["conductor_overhead"] = conductor_overhead(rt, step_of(compiled), sync)
    results["stats"] = rt.stats()
    return results


def conductor_overhead(rt, step, sync, steps: int = 3) -> dict:
    """Host ms per step with the conductor's admission on and off (what `enabled: false` saves)."""
    out = {}
    for label, admit in (("on", True), ("off", False)):
        rt.planner._admit = admit and rt.planner.conductor.enabled
        host = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)
            sync()
        out[f"host_ms_{label}"] = round(statistics.median(host), 2)
    rt.planner._admit = rt.planner.conductor.enabled
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in results["rows"] if "budget_gib" in r and "step_ms" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([r["budget_gib"] for r in sweep], [r["step_ms"] for r in sweep], "o-", label="planned (measured)")
    ax.plot([r["budget_gib"] for r in sweep], [r["predicted_ms"] for r in sweep], "x--", label="planned (predicted)")
    for r in results["rows"]:
        if r.get("mode", "").startswith(("resident", "two-slot")) and r.get("step_ms"):
            ax.axhline(r["step_ms"], linestyle=":", color="gray")
            ax.annotate(f"{r['mode']} ({r.get('peak_gib')} GiB)", (ax.get_xlim()[0], r["step_ms"]), fontsize=8)
    ax.set_xlabel("VRAM budget (GiB)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"{results['model']}: step time against the VRAM budget ({results['env']['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["flux", "qwen"], required=True)
    parser.add_argument("--budgets", nargs="+", type=float, default=[4, 8, 12, 16, 20, 24], help="GiB (GPU)")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.3, 0.6, 1.2],
                        help="--tiny: budgets as fractions of the streamed INT8 bytes")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a small config of the same class (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trace-budgets", nargs="*", type=float, default=[],
                        help="GiB budgets to run one more step of under torch.profiler: compute / copy / idle lanes")
    parser.add_argument("--profile-budgets", nargs="*", type=float, default=[],
                        help="GiB budgets (and the resident row) to profile one more step of: GPU ops, host functions")
    parser.add_argument("--skip-ckpt-ref", action="store_true", help="no resident checkpointed row (Qwen)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.out = args.out or os.path.join(RESULTS, f"budget_sweep_{args.model}{'_tiny' if args.tiny else ''}.json")
    results = run(args)
    cols = ["mode", "ckpt", "step_ms", "ratio", "peak_gib", "under_budget", "h2d_gb_step", "d2h_gb_step", "resident",
            "streamed", "recomputed", "spilled", "slots", "predicted_ms", "pred_err", "error"]
    print_table([[r.get(c, "") for c in cols] for r in results["rows"]], headers=cols,
                title=f"budget sweep, {args.model} {results['shape']}, int8, {results['env']['device']}")
    print(f"conductor admission host cost: {results['conductor_overhead']}")
    write_json(args.out, results)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
