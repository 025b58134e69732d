"""Budget sweep: one VRAM budget in, the plan the runtime picks, measured against the resident model.

    python benches/budget_sweep.py --model qwen --budgets 8 12 16 20 24          # GiB, on the GPU
    python benches/budget_sweep.py --model flux --budgets 12 16 20
    python benches/budget_sweep.py --model qwen --tiny --device cpu              # a smoke test of the bench

Per model (benches/models.py builders: Qwen2.5-7B shape at sequence 2048 with
its checkpointing off, Flux-dev 12B with its checkpointing on; LoRA r=16,
AdamW), in this one process:

1. the resident baselines (everything on the GPU), each labelled:
   "resident (eager)" and "resident (inductor)", the same model and step
   function under `torch.compile` with its default backend and options (its
   first step is the compile: `compile_s`; `--inductor-limit-s` bounds it,
   `--baselines eager` leaves it out); for Qwen also with checkpointing on,
   eager, and under Inductor with `--ckpt-inductor`;
2. `offload(precision=--precision)` (int8 unless told) with no budget: the fixed two-slot plan;
3. one budget set (the largest): two steps under the smallest plan, the
   second measured (calibration: per-block times and activation bytes);
4. "resident int8": the stagehand runtime, int8, with a budget every block
   fits in (`--resident-int8-gib`, 70): what streaming costs against int8
   weights that never move;
5. per budget: `rt.replan(vram_budget=...)`, the plan's first step (new
   variants compile), one more, then `--steps` measured steps: step time,
   peak GPU memory (must be under the budget), H2D and D2H GB per step, the
   plan's counts, predicted vs measured step time.

Every stagehand row has `ratio_inductor` (to the compiled resident: the ratio
that counts, printed first) and `ratio_eager` (Qwen also `*_ckpt`, to the
checkpointed resident); `ratio` is the old field (= ratio_eager). Peaks, every
row: `peak_gib` (max_memory_allocated) and `peak_reserved_gib`
(max_memory_reserved) over the timed steps, and `first_step_s`,
`first_step_peak_gib`, `first_step_peak_reserved_gib` for the row's first step
alone (for a plan, the step that compiles its variants and checks its peak).

Tables, JSON (written after every row) and a PNG of step time against budget
with the baselines and the two-slot plan as reference lines. On the CPU
(`--tiny`) budgets are fractions of the streamed bytes (the budget bounds the
device copy of the weights there) and the run only checks that every stage
works.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
from _common import (PEAK_COLUMNS, RATIO_COLUMNS, RATIOS_NOTE, RESULTS, Sync, add_ratios, env_info, first_step,
                     inductor_settings, print_header, print_rows, resident_label, resident_row, write_json)
from models import LORA_TARGETS, build_flux, build_qwen, make_step, profile_step, set_checkpointing

import torch_stagehand as stagehand

GiB = 2**30


def timed(label: str, step, steps: int, sync: Sync, rt=None, warmup: int = 1) -> dict:
    """The first step on its own, `warmup - 1` more untimed, then `steps` timed ones.

    A new plan's first step compiles the variants it needs and measures its peak against the prediction (a
    peak over the budget re-plans at that step's end): its seconds and peaks (allocated, reserved) are the
    row's first_step_* fields; peak_gib / peak_reserved_gib are over the timed steps only."""
    first = first_step(step, sync)
    for _ in range(warmup - 1):
        step()
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
           "steps_ms": [round(t, 1) for t in times], **sync.peaks(), **first,
           # Python's garbage collections per step by generation: a full (gen 2) one over a compiled
           # model's heap can stall the host for tens of ms
           "gc_per_step": [round((g["collections"] - b) / steps, 2) for g, b in zip(gc.get_stats(), gc_before)]}
    if rt is not None:
        after = rt.stats()
        row["h2d_gb_step"] = float(f"{(after['h2d_bytes'] - before['h2d_bytes']) / steps / 1e9:.4g}")
        row["d2h_gb_step"] = float(f"{(after['d2h_bytes'] - before['d2h_bytes']) / steps / 1e9:.4g}")
        row["sync_fetches_step"] = (after["sync_fetches"] - before["sync_fetches"]) / steps
    print(f"  {label}: {row['step_ms']} ms (steps {row['steps_ms']}), peak {row['peak_gib']} GiB allocated, "
          f"{row['peak_reserved_gib']} reserved; first step {row['first_step_s']} s, peak {row['first_step_peak_gib']}"
          f" GiB allocated, {row['first_step_peak_reserved_gib']} reserved", flush=True)
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
    model = vars(rt.plan_driver.cost_model)
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
    results: dict = {"env": env, "model": args.model, "precision": args.precision, "tiny": args.tiny, "rows": []}
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11's cuDNN SDPA backward faults at Flux's shape
    results["inductor"] = inductor_settings()  # before any compile: how warm its cache was
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, inputs, shape = (build_flux if args.model == "flux" else build_qwen)(args.tiny, device)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS[args.model]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ckpt = args.model == "flux"  # the set-ups: Qwen without checkpointing, Flux with
    results.update(shape=shape, build_s=round(time.perf_counter() - t0, 1), ckpt=ckpt)
    results["ratios"] = dict(RATIOS_NOTE, **{f"{r}_ckpt": f"as {r}, to the checkpointed resident (Qwen)"
                                           for r in RATIO_COLUMNS})
    rows = results["rows"]

    def step_of(fn):
        return make_step(args.model, model, fn, inputs, optimizer)

    def measured(label: str, step) -> dict:
        return timed(label, step, args.steps, sync)

    def profile_resident(label: str, step) -> None:
        if device == "cuda" and args.profile_budgets:
            results.setdefault("profiles", {})[label] = profiles(step, sync)

    # The resident baselines, at the sweep's checkpointing and (Qwen) with checkpointing on too: eager, and the
    # same model and step under torch.compile's defaults. baselines[ckpt][compiler] is the row.
    baselines: dict[bool, dict[str, dict]] = {False: {}, True: {}}
    sets = [(ckpt, "resident")] + ([(True, "resident ckpt")] if args.model == "qwen" and not args.skip_ckpt_ref else [])
    for on, what in sets:
        set_checkpointing(args.model, model, on)
        for compiler in ("eager", "inductor"):
            if compiler not in args.baselines or (compiler == "inductor" and on != ckpt and not args.ckpt_inductor):
                continue
            label = resident_label(compiler, what) if compiler == "eager" or not args.inductor_regional else \
                f"{what} (inductor, regional)"
            row = resident_row(compiler, model, step_of, measured, label, args.inductor_limit_s, also=profile_resident,
                               regional=args.inductor_regional)
            baselines[on][compiler] = row
            rows.append(dict(row, ckpt=on))
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    set_checkpointing(args.model, model, ckpt)

    def with_ratios(row: dict) -> dict:
        add_ratios(row, baselines[ckpt])
        if not ckpt and baselines[True]:  # Qwen: also to the checkpointed resident (the target at small budgets)
            add_ratios(row, baselines[True], suffix="_ckpt")
        if row.get("ratio_eager") is not None:
            row["ratio"] = row["ratio_eager"]  # the field's old meaning (before ratio_inductor existed)
        return row

    for row in rows:  # the baselines against each other
        add_ratios(row, baselines[row["ckpt"]])
    write_json(args.out, results)
    if args.baselines_only:
        return results

    t0 = time.perf_counter()
    rt = stagehand.offload(model, device=device, precision=args.precision)
    results["offload_s"] = round(time.perf_counter() - t0, 1)
    rt.attach(optimizer)
    streamed = sum(rt.block_nbytes(b, args.precision) for b in range(len(rt.blocks)))
    compiled = torch.compile(model, backend="stagehand")
    rows.append(with_ratios(dict(timed("two-slot (no budget)", step_of(compiled), args.steps, sync, rt),
                                 **plan_columns(rt), ckpt=ckpt)))
    write_json(args.out, results)

    budgets = [(f"{b} GiB", int(b * GiB)) for b in args.budgets] if not args.tiny else \
        [(f"{f:.2f} x weights", int(f * streamed)) for f in args.fractions]
    budgets.sort(key=lambda item: -item[1])
    plans = [(f"budget {name}", nbytes, False) for name, nbytes in budgets]
    if not args.skip_resident_int8:  # every block resident in int8: the budget far above what the model needs
        nbytes = int(args.resident_int8_fraction * streamed) if args.tiny else int(args.resident_int8_gib * GiB)
        plans.insert(0, (f"resident {args.precision} (stagehand, budget {nbytes / GiB:.3g} GiB)", nbytes, True))
    rt.replan(vram_budget=plans[0][1])  # calibrate once, under the smallest plan
    for _ in range(2):
        step_of(compiled)()
    sync()
    results["cost_model"] = cost_model_record(rt)  # as calibrated
    for label, nbytes, all_resident in plans:
        try:
            rt.replan(vram_budget=nbytes)
        except ValueError as e:  # BudgetError: no plan fits
            rows.append({"mode": label, "vram_budget_gib" if all_resident else "budget_gib": round(nbytes / GiB, 3),
                         "error": str(e)[:120]})
            print(f"  {label}: {e}", flush=True)
            continue
        row = dict(timed(label, step_of(compiled), args.steps, sync, rt, warmup=2), **plan_columns(rt))
        row["plan_corrections"] = list(rt.stats()["plan_corrections"])
        budget_gib = round(nbytes / GiB, 6)
        # the resident int8 row's budget is no sweep point: its own key, so readers of budget_gib skip it
        row.update({"vram_budget_gib" if all_resident else "budget_gib": budget_gib}, ckpt=ckpt,
                   pred_err=round(row["predicted_ms"] / row["step_ms"] - 1, 3) if row["step_ms"] else None)
        if all_resident:
            row["all_resident"] = row["resident"] == len(rt.blocks)
            if not row["all_resident"]:
                print(f"  {label}: only {row['resident']} of {len(rt.blocks)} blocks resident", flush=True)
        if row["peak_gib"] is not None:
            row["under_budget"] = row["peak_gib"] <= nbytes / GiB
        if ckpt and row["recomputed"] < len(rt.blocks):  # unequal recompute, said in the row (the baseline's is all)
            row["recompute_note"] = (f"recomputes {row['recomputed']} of {len(rt.blocks)} blocks; the resident "
                                     f"baselines recompute all {len(rt.blocks)}")
        with_ratios(row)
        if device == "cuda" and budget_gib in args.trace_budgets:
            row["gpu_lanes"] = gpu_lanes(step_of(compiled))
            print(f"  {label}: GPU lanes {row['gpu_lanes']}", flush=True)
        if device == "cuda" and budget_gib in args.profile_budgets:
            results.setdefault("profiles", {})[label] = profiles(step_of(compiled), sync)
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
        rt.plan_driver._admit = admit and rt.plan_driver.conductor.enabled
        host = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)
            sync()
        out[f"host_ms_{label}"] = round(statistics.median(host), 2)
    rt.plan_driver._admit = rt.plan_driver.conductor.enabled
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in results["rows"] if r.get("mode", "").startswith("budget") and r.get("step_ms")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([r["budget_gib"] for r in sweep], [r["step_ms"] for r in sweep], "o-", label="planned (measured)")
    ax.plot([r["budget_gib"] for r in sweep], [r["predicted_ms"] for r in sweep], "x--", label="planned (predicted)")
    for r in results["rows"]:
        if r.get("mode", "").startswith(("resident", "two-slot")) and r.get("step_ms"):
            style = "-" if r.get("baseline") == "inductor" else ":"  # the compiled baseline drawn solid
            ax.axhline(r["step_ms"], linestyle=style, color="gray")
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
    parser.add_argument("--skip-ckpt-ref", action="store_true", help="no resident checkpointed rows (Qwen)")
    parser.add_argument("--baselines", nargs="+", choices=["eager", "inductor"], default=["eager", "inductor"],
                        help="the resident baselines to measure: eager, and torch.compile with its default backend "
                             "(Inductor) and options; the ratio to inductor is the one that counts")
    parser.add_argument("--inductor-regional", action="store_true",
                        help="compile the resident baseline per repeated block (diffusers' compile_repeated_blocks) "
                             "instead of as one graph: Flux's whole-graph compile takes ~6 minutes")
    parser.add_argument("--ckpt-inductor", action="store_true",
                        help="Qwen: also the checkpointed resident under Inductor (one more whole-model compile)")
    parser.add_argument("--inductor-limit-s", type=float, default=0,
                        help="stop a resident Inductor row after this many seconds, compile included; the row then "
                             "records the error and the sweep goes on (0: no limit)")
    parser.add_argument("--baselines-only", action="store_true",
                        help="stop after the resident rows (e.g. to fill Inductor's cache before a timed-out run)")
    parser.add_argument("--precision", choices=["int8", "bf16"], default="int8",
                        help="the streamed blocks' precision (bf16: the row beside the bf16 peers)")
    parser.add_argument("--skip-resident-int8", action="store_true", help="no 'resident int8' row")
    parser.add_argument("--resident-int8-gib", type=float, default=70,
                        help="the budget of the 'resident int8' row (large enough that every block stays resident)")
    parser.add_argument("--resident-int8-fraction", type=float, default=10,
                        help="--tiny: that budget as a multiple of the streamed INT8 bytes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.out = args.out or os.path.join(RESULTS, f"budget_sweep_{args.model}{'_tiny' if args.tiny else ''}.json")
    results = run(args)
    rows, env = results["rows"], results["env"]
    title = f"budget sweep, {args.model} {results['shape']}, {args.precision}, {env['device']}, commit {env['commit'][:12]}"
    print_rows(rows, ["mode", "ckpt", "step_ms", *RATIO_COLUMNS, *(f"{r}_ckpt" for r in RATIO_COLUMNS),
                      "peak_gib", "peak_reserved_gib", "budget_gib", "under_budget", "error"],
               title=f"{title}: step time against the resident baselines (same run)")
    print_rows(rows, ["mode", *PEAK_COLUMNS[2:], "compile_s", "h2d_gb_step", "d2h_gb_step", "resident", "streamed",
                      "recomputed", "spilled", "slots", "predicted_ms", "pred_err"],
               title=f"{title}: first steps and plans")
    print("baselines: resident (inductor) = the plain model under torch.compile's default backend and options; "
          "resident (eager) = the plain model run eagerly; both every weight on the device", flush=True)
    if not any(r.get("baseline") == "inductor" and r.get("step_ms") for r in rows):
        print("NOTE: no resident (inductor) step in this run: the ratios are to the eager resident only, which "
              "flatters them", flush=True)
    if "conductor_overhead" in results:
        print(f"conductor admission host cost: {results['conductor_overhead']}")
    write_json(args.out, results)
    if not args.baselines_only:
        plot(results, os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
