"""Seconds to the first step: cold start, warm start, and the steps after a new plan.

    python benches/start_time.py --rows qwen:int8 qwen:bf16 qwen:resident --out benches/results/start_time_qwen.json
    python benches/start_time.py --rows flux:int8 flux:bf16 --out benches/results/start_time_flux.json
    python benches/start_time.py --tiny --device cpu --rows qwen:int8 --steps 4     # a smoke test of the bench
    python benches/start_time.py --rows flux:int8:blocks flux:resident:blocks      # regional: a compile per block
    python benches/start_time.py --rows flux:int8:files:blocks --drop-page-cache   # offload from checkpoint + slab
    python benches/start_time.py --rows flux:int8:files:blocks --bytecode-cache    # with .pyc files, as installed

Every run is a fresh process (the thing a user starts many times a day), on the full-size model of
benches/models.py (random init on the GPU, bf16, peft LoRA r=16 on the attention projections, AdamW;
Flux with its own checkpointing, Qwen without), offloaded under the documented budget for it (Flux 16 GiB,
Qwen-7B 20 GiB) and compiled with `backend="stagehand"`. Per row (model, precision) the runs are, in order:

- cold: empty caches (stagehand's: the W8A16 tune file, the compile bundle; Inductor's; Triton's), with
  the default ahead-compile workers (two on CUDA; `--ahead-workers N` sets them) compiling the variants the step will ask for next (compiler/startup/ahead.py);
- serial (`--modes ... serial`): cold, with no such workers: the baseline the cold row's `vs_serial` divides by;
- warm: a second process on the same machine, every cache as the cold run left it;
- bundle (`--modes ... bundle`): a fresh Inductor and Triton cache, stagehand's kept: a machine that lost /tmp,
  with only the compile bundle (compiler/startup/compile_cache.py) to start from;
- profile (`--modes ... profile`): a warm run whose first step runs under cProfile (`first_step_profile`:
  where its seconds go; the profiler makes it slower, so it is a run of its own, not the warm row's);
  coldprofile: the same of a serial run (empty caches, no workers): where a cold compile's seconds go.

A row `model:int8:files` builds the model on the meta device and offloads it from its safetensors checkpoint
and INT8 slab on disk (written once under the cache root from the same random init; `keep_full="file"`), then
adds the LoRA adapters: a user's model on disk (`--drop-page-cache`: its cold run reads the disk, not the page
cache). A row `model:precision:blocks` compiles each block on its own (`stagehand.compile_blocks`; for a resident row,
`block.compile()` per block as diffusers' `compile_repeated_blocks` does) instead of the whole model.
"resident" rows are the baseline: the plain model, every weight on the GPU, under torch.compile's
default backend (Inductor), cold and warm the same way. Per run: offload seconds (with a profile of
the cold int8 offload: where its seconds go), the first step's seconds, each later step's milliseconds
(the calibration and new-plan steps among them, the plan kind beside each, and each step's one-time work:
units compiled, loaded or first run, the collector, new device segments, H2D), the steady step (median of
the last three), units compiled and loaded, compile and autotune seconds, and the first step's loss:
a warm run computes the cold run's number exactly.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time

BUDGETS = {"flux": "16GiB", "qwen": "20GiB", "qwen32": "40GiB"}  # qwen32: the Qwen2.5-32B shape
ROOT = os.environ.get("START_TIME_CACHE_ROOT", "/tmp/stagehand-start-time")


def child(args) -> dict:
    """One process: build, offload, compile, `--steps` steps, each synchronised and timed."""
    from _common import CollectorClock

    args.gc_clock = CollectorClock()  # the collector's seconds, read at offload's end and the first step's
    import peft
    import torch
    from models import LORA_TARGETS, set_checkpointing

    import torch_stagehand as stagehand

    device = args.device
    cuda = device == "cuda"
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # as benches/models.py: cuDNN SDPA backward faults at Flux's shape
    kind, precision, *how = args.row.split(":")
    regional = "blocks" in how  # compile each block on its own (stagehand.compile_blocks; resident: block.compile())
    if "files" in how:
        return child_from_files(args, kind, precision, regional)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, inputs, shape = build(kind, args.tiny, device)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS[kind]))
    set_checkpointing(kind, model, kind == "flux")
    if kind != "flux":  # a training step keeps no KV cache (and a regional compile would retrace every block for it)
        model.config.use_cache = False
    build_s = time.perf_counter() - t0
    out: dict = {"row": args.row, "mode": args.mode, "shape": shape, "build_s": round(build_s, 1)}
    rt = None
    if precision != "resident":
        rt = timed_offload(args, out, model, precision=precision, vram_budget=None if args.tiny else BUDGETS[kind])
        compiled = stagehand.compile_blocks(model) if regional else torch.compile(model, backend="stagehand")
    elif regional:  # torch's own regional compilation of the resident model (diffusers' compile_repeated_blocks)
        for block in _blocks_of(kind, model):
            block.compile()
        compiled = model
    else:
        compiled = torch.compile(model)
    return run_steps(args, kind, model, inputs, rt, out, regional, compiled)


def _top(profiler: cProfile.Profile, order: str, lines: int) -> str:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(lines)
    return text.getvalue()[-9000:]


def timed_offload(args, out: dict, model, **offload_kwargs):
    """`stagehand.offload(model, **offload_kwargs)`, timed into `out["offload_s"]` (and profiled when asked)."""
    import torch

    import torch_stagehand as stagehand

    profiler = cProfile.Profile() if args.profile_offload else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    rt = stagehand.offload(model, device=args.device, verbose=False, **offload_kwargs)
    if args.device == "cuda":
        torch.cuda.synchronize()
    if profiler:
        profiler.disable()
        out["offload_profile"] = _top(profiler, "cumulative", 25)[-6000:]
    out["offload_s"] = round(time.perf_counter() - t0, 2)
    # offload's own clock per stage (find blocks, host store planned, slab rows read, ...): where its seconds went;
    # and what ran beside a stage on other threads (the slab's reads, the compiler's imports beside them)
    out["offload_stages_s"] = {k: round(v, 2) for k, v in (rt.offload_summary or {}).get("seconds", {}).items()}
    out["offload_beside_s"] = {k: round(v, 2) for k, v in (rt.offload_summary or {}).get("beside", {}).items()}
    out["gc_to_offload_end"] = args.gc_clock.read()
    return rt


class TritonCompiles:
    """The Triton compiles this process ran (Triton's compilation listener: the W8A16 kernels the eager forward
    launches, the tuner's candidates; not Inductor's, whose pool compiles in other processes), each as
    (start, seconds, kernel) on the perf_counter clock: what a cold first step spent compiling in the main
    process, and when."""

    def __init__(self):
        self.events: list[tuple[float, float, str]] = []
        try:
            from triton import knobs
        except ImportError:  # no Triton (a CPU run), or one without knobs
            return
        if hasattr(knobs, "compilation") and hasattr(knobs.compilation, "listener"):
            knobs.compilation.listener = self._heard

    def _heard(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if not cache_hit:
            seconds = times.total / 1e6
            name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")
            self.events.append((time.perf_counter() - seconds, seconds, str(name)))

    def summary(self, t0: float, end: float, clock0: float) -> dict:
        """The compiles between `t0` and `end` (the first step), their starts on the clock that began at
        `clock0`."""
        inside = [e for e in self.events if t0 <= e[0] + e[1] and e[0] <= end]
        per_kernel: dict[str, list] = {}
        for _, seconds, name in inside:
            entry = per_kernel.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] = round(entry[1] + seconds, 3)
        return {"count": len(inside), "seconds": round(sum(e[1] for e in inside), 3), "per_kernel": per_kernel,
                "step_start_s": round(t0 - clock0, 3),
                "events": [[round(a - clock0, 3), round(s, 3), n] for a, s, n in inside[:60]]}


def _work_counters(rt, gc_clock) -> dict:
    """Counters of one-time work, read on the host after a step's synchronisation: the collector's seconds and its
    full collections, units compiled, loaded and run for the first time, the allocator's new device segments and
    reserved GiB, the slot pool's host-to-device GiB and the fetches a wait had to issue itself."""
    import torch

    counters = {"gc_s": sum(gc_clock.seconds), "gc_full": gc_clock.counts[2]}
    if rt is not None:
        counters.update(compiled=rt.compile_count, loaded=rt.units_loaded, first_run=rt.units_first_run,
                        h2d_gib=rt.pool.stats.h2d_bytes / 2**30, sync_fetches=rt.pool.stats.sync_fetches)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        counters.update(device_allocs=torch.cuda.memory_stats().get("num_device_alloc", 0),
                        reserved_gib=torch.cuda.memory_reserved() / 2**30)
    return counters


def run_steps(args, kind: str, model, inputs, rt, out: dict, regional: bool, compiled=None) -> dict:
    """`--steps` steps of AdamW on the adapters, each synchronised and timed; what they compiled and loaded."""
    import torch
    from models import loss_of, set_checkpointing

    import torch_stagehand as stagehand

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if compiled is None:
        set_checkpointing(kind, model, kind == "flux")
        if kind != "flux":
            model.config.use_cache = False
        compiled = stagehand.compile_blocks(model) if regional else torch.compile(model, backend="stagehand")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    if rt is not None:
        rt.attach(optimizer)
    steps, losses, plans, plan_changes = [], [], [], []

    def train_step():
        """One step: forward, backward, AdamW, synchronised (the timed steps and the re-plan rounds' alike)."""
        loss = loss_of(kind, compiled(**inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return loss
    out["profiled_steps"] = args.profile_steps if args.profile_first_step else []
    traced = range(min(args.trace_steps), max(args.trace_steps) + 1) if args.trace_steps and args.mode == "cold" else ()
    out["traced_steps"] = list(traced)
    tracer = None
    triton_compiles, first_step = TritonCompiles(), (0.0, 0.0)
    out["step_work"] = []  # per step: the one-time work in it (what a slow new-plan step is suspected of)
    before = _work_counters(rt, args.gc_clock)
    for i in range(args.steps):
        profiler = cProfile.Profile() if args.profile_first_step and i in args.profile_steps else None
        if i in traced and tracer is None:  # started before the step's clock: the profiler's own start-up is not in it
            tracer = start_trace()
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        with _step_range(tracer, i):
            loss = train_step()
        steps.append(time.perf_counter() - t0)
        now = _work_counters(rt, args.gc_clock)  # before the profile's and the trace's export: the step's own work
        out["step_work"].append({k: round(now[k] - before[k], 3) for k in now})
        before = now
        if i == 0:
            first_step = (t0, time.perf_counter())
        if profiler:  # where a step's seconds go (the profiler's own cost inflates them: a separate run)
            profiler.disable()
            name = "first_step" if i == 0 else f"step_{i + 1}"
            out[f"{name}_profile"] = {order: _top(profiler, order, 40) for order in ("cumulative", "tottime")}
            if args.profile_dir:  # the whole profile, for pstats
                profiler.dump_stats(os.path.join(args.profile_dir,
                                                 f"{name}_{args.row.replace(':', '-')}_{args.mode}.prof"))
        if tracer is not None and i == traced[-1]:
            out["trace"] = end_trace(tracer, args, [f"step_{j + 1}" for j in traced])
            tracer = None
        losses.append(loss.item())
        plans.append(rt.plan.kind if rt is not None and rt.plan is not None else "")
        if rt is not None and rt.plan is not None and (not plan_changes or plan_changes[-1][1] != rt.plan.summary()):
            plan_changes.append((i + 1, rt.plan.summary()))  # the plan the next step runs, after step i + 1
        if i == 0:  # the collector's seconds to the first step's end (from the process's start)
            out["gc_to_first_step_end"] = args.gc_clock.read()
        if i == 0 and rt is not None:  # the units the first step compiled (a re-plan's compile later)
            out["first_step_compile_s"] = round(rt.compile_seconds, 2)
            # Dynamo's graphs by then: a regional run after the first traces no block apart (residual_hints.py)
            out["dynamo_graphs"] = len(rt.graph_records)
    out.update(first_step_s=round(steps[0], 2), step_ms=[round(s * 1e3, 1) for s in steps[1:]], plan_kinds=plans,
               steady_ms=round(statistics.median(steps[-3:]) * 1e3, 1), first_loss=losses[0])
    if rt is not None and args.replans:

        def one_step() -> float:
            t0 = time.perf_counter()
            train_step()
            return time.perf_counter() - t0

        out["replan_rounds"] = replan_rounds(rt, one_step, args.replans, sync,
                                             lambda: _work_counters(rt, args.gc_clock))
    if rt is not None:
        s = rt.stats()
        out.update({k: s[k] for k in ("compiled_units", "units_loaded", "units_compiled_cold", "compile_seconds",
                                      "autotune_seconds", "compiled_variants")})
        # Why the plan changed and what it was: corrections (peaks learned, budgets shrunk), out-of-memory recoveries
        out.update(plan_changes=plan_changes, plan_corrections=s["plan_corrections"],
                   calibration_remeasured=s["calibration_remeasured"], plan_reservations=s["plan_reservations"],
                   oom_recoveries=s["oom_recoveries"], gc_freezes=s["gc_freezes"])
        out["cost_model_cache"] = s["cost_model_cache"]  # a warm run plans from the model the cold run measured
        # A slab's rows read behind offload: their seconds from the reads' start, the fetches' wait for them
        out["slab_rows_behind"] = s["slab_rows_behind"]
        from torch_stagehand.compiler.variants import variant_cache

        # How each unit came to be: "hit", "miss" (compiled and stored) or "bypass: <torch's reason>", and its seconds.
        cache = variant_cache(rt)
        out["unit_cache"] = [f"{info['label']}: {info.get('cache')} {info['seconds']:.2f}s ({info.get('why')})"
                             + (f" [{info['ahead']}]" if info.get("ahead") else "") for info in cache.info.values()]
        clock0 = first_step[0]
        out["main_triton_compiles"] = triton_compiles.summary(*first_step, clock0)
        if cache.ahead is not None:  # variants compiled ahead in worker processes (compiler/startup/ahead.py)
            stats = cache.ahead.stats
            out["ahead"] = dict(stats, workers=cache.ahead.size, gpu_processes=_gpu_processes())
            out["ahead_summary"] = (f"{sum('compiled ahead' in line for line in out['unit_cache'])} of "
                                    f"{stats['submitted']} ahead, waited {stats['waited_s']:.1f}s")
        from torch_stagehand.kernels.tuning import autotune as tune

        tuned = tune.tuning_log().values()  # the keys this process tuned (none when the picks came from disk)
        out["tuning"] = {"keys": sum(1 for t in tuned if not t.get("from_disk")),
                         "candidates": sum(len(t["times_us"]) + len(t["rejected"]) for t in tuned),
                         "precompile_s": round(sum(t.get("precompile_s", 0.0) for t in tuned), 2),
                         "threads": tune.precompile_threads(),
                         # per key (kind, M bucket, N, K): candidates timed + rejected, and the one chosen
                         "per_key": {f"{k[0]} M{k[2]} N{k[3]} K{k[4]}": [len(t["times_us"]) + len(t["rejected"]),
                                                                       str(t["chosen"])]
                                     for k, t in tune.tuning_log().items()}}
    else:
        from torch._dynamo.utils import counters

        out.update(units_loaded=counters["aot_autograd"].get("autograd_cache_hit", 0),
                   units_compiled_cold=counters["aot_autograd"].get("autograd_cache_miss", 0))
    from torch._dynamo.utils import compilation_time_metrics as metrics
    from torch_stagehand.compiler.startup.process_settings import autotune_choice

    # The Inductor kernels that keep several launch configs, timed at their first launch (compiler/inner.py)
    out["inductor_autotune"] = autotune_choice()

    # Where the first step's seconds went: Dynamo's capture (with the backend's graph passes; stagehand's units
    # compile later, lazily: first_step_compile_s), the units, the W8A16 autotuning; the rest ran the step.
    out["dynamo_s"] = round(sum(metrics.get("_compile.compile_inner", [])), 2)
    out["first_step_rest_s"] = round(out["first_step_s"] - out["dynamo_s"] - out.get("first_step_compile_s", 0), 2)
    return out


def replan_rounds(rt, one_step, rounds: int, sync, counters, steady: int = 3) -> dict:
    """The steps that measure a new plan, against steady steps of the same plan, `rounds` times in one process:
    `rt.replan()` (between steps, like any re-plan), the steps that measure the new plan (block clocks on events
    read a step later, the peak check), then `steady` steps that measure nothing. One cold run's two new-plan
    steps against its steady step spread as far as single steps do (0.93-1.14); many rounds separate the
    measuring's cost from that spread. The re-plan is synchronised, as a calibration step's is (the new plan's
    resident blocks go up the link there): its seconds and host-to-device GiB are the round's `replan_s` and
    `replan_h2d_gib`; each step's one-time work is in `work` (units compiled / run first, H2D GiB)."""
    from torch_stagehand.runtime.conductor.driver import REFINE_STEPS

    out = []
    for _ in range(rounds):
        before = counters()
        t0 = time.perf_counter()
        plan = rt.replan()
        sync()
        replan_s = time.perf_counter() - t0
        after = counters()
        measuring, rest, work = [], [], []
        for i in range(REFINE_STEPS + steady):
            (measuring if i < REFINE_STEPS else rest).append(one_step())
            now = counters()
            work.append([now.get(k, 0) - after.get(k, 0) for k in ("compiled", "first_run")]
                        + [round(now.get("h2d_gib", 0) - after.get("h2d_gib", 0), 2)])
            after = now
        out.append({"replan_s": round(replan_s, 3), "plan": plan.summary(),
                    "replan_h2d_gib": round(after.get("h2d_gib", 0) - before.get("h2d_gib", 0)
                                            - sum(w[2] for w in work), 2),
                    "measuring_ms": [round(x * 1e3, 1) for x in measuring], "steady_ms": [round(x * 1e3, 1) for x in rest],
                    "work": work, "ratio": round(statistics.mean(measuring) / statistics.median(rest), 4)})
    ratios = [r["ratio"] for r in out]
    measuring = [x for r in out for x in r["measuring_ms"]]
    steady_all = [x for r in out for x in r["steady_ms"]]
    return {"rounds": out, "median_ratio": round(statistics.median(ratios), 4), "max_ratio": max(ratios),
            "pooled_ratio": round(statistics.mean(measuring) / statistics.mean(steady_all), 4),
            "steady_spread": [round(min(steady_all) / statistics.median(steady_all), 4),
                              round(max(steady_all) / statistics.median(steady_all), 4)]}


def start_trace():
    """A torch.profiler trace (host ops and the GPU's kernels and copies) of the steps `--trace-steps` names."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if torch.cuda.is_available() else [])
    tracer = torch.profiler.profile(activities=acts)
    tracer.start()
    return tracer


def _step_range(tracer, i: int):
    import contextlib

    import torch

    return torch.profiler.record_function(f"step_{i + 1}") if tracer is not None else contextlib.nullcontext()


def end_trace(tracer, args, steps: list[str]) -> dict:
    """Stop the trace; per traced step: its wall time, the GPU's busy time (kernels and copies, all streams,
    overlaps counted once) and the GPU's idle gaps over 1 ms, with the host ops that ran during the longest;
    the top host and GPU ops over the traced steps; the chrome trace gzipped into `--profile-dir`."""
    import gzip

    tracer.stop()
    events = tracer.events()
    ranges = {e.name: (e.time_range.start, e.time_range.end) for e in events
              if e.name in steps and e.device_type.name == "CPU"}  # (the GPU's annotation of a step is another)
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    host = [e for e in events if e.device_type.name == "CPU" and e.name not in steps]
    summary: dict = {}
    for name, (lo, hi) in ranges.items():
        busy, gaps, cursor = 0.0, [], lo
        for a, b in gpu:
            if b <= lo or a >= hi:
                continue
            a, b = max(a, lo), min(b, hi)
            if a > cursor:
                gaps.append((cursor, a))
            busy += max(0, b - max(a, cursor))
            cursor = max(cursor, b)
        if hi > cursor:
            gaps.append((cursor, hi))
        long = sorted((g for g in gaps if g[1] - g[0] > 1000), key=lambda g: g[0] - g[1])[:8]
        summary[name] = {
            "wall_ms": round((hi - lo) / 1e3, 2), "gpu_busy_ms": round(busy / 1e3, 2),
            "gaps_over_1ms": [{"at_ms": round((a - lo) / 1e3, 1), "ms": round((b - a) / 1e3, 2),
                               "host": _host_ops_in(host, a, b)} for a, b in long]}
    averages = tracer.key_averages()
    summary["top_host"] = averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    summary["top_gpu"] = averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70)
    if args.profile_dir:
        path = os.path.join(args.profile_dir, f"trace_{args.row.replace(':', '-')}_{args.mode}.json")
        tracer.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
            z.write(f.read())
        os.remove(path)
        summary["file"] = path + ".gz"
    return summary


def _host_ops_in(host: list, a: float, b: float) -> list[str]:
    """The host ops that ran longest inside [a, b] (clipped to it), as 'name ms'."""
    spent: dict[str, float] = {}
    for e in host:
        lo, hi = max(a, e.time_range.start), min(b, e.time_range.end)
        if hi > lo:
            spent[e.name] = spent.get(e.name, 0.0) + (hi - lo)
    return [f"{n} {t / 1e3:.1f}" for n, t in sorted(spent.items(), key=lambda kv: -kv[1])[:6]]


def _gpu_processes() -> list[str]:
    """The processes holding GPU memory now (nvidia-smi): the ahead-compile workers must not be among them."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"nvidia-smi: {e}"]
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] + [f"this process: {os.getpid()}"]


def build(kind: str, tiny: bool, device: str):
    """(model, inputs, shape) of a row's model: flux, qwen (Qwen2.5-7B's shape) or qwen32 (Qwen2.5-32B's)."""
    from models import build_flux, build_qwen

    if kind == "flux":
        return build_flux(tiny, device)
    return build_qwen(tiny, device, "32b" if kind == "qwen32" else "7b")


def _files_of(kind: str, tiny: bool) -> dict[str, str]:
    folder = os.path.join(ROOT, "files", kind + ("-tiny" if tiny else ""))
    return {"folder": folder, "checkpoint": os.path.join(folder, "checkpoint"), "slab": os.path.join(folder, "slab", kind)}


def prepare_files(args, kind: str) -> dict:
    """Once per model (kept under ROOT/files): its safetensors checkpoint (`save_pretrained`) and its INT8 slab,
    from the random init the other rows use, for the `:files` rows: a user's model on disk."""
    import torch
    from torch_stagehand.runtime.slab import build_slab_from_module

    files = _files_of(kind, args.tiny)
    if os.path.exists(os.path.join(files["folder"], "done")):
        return {"prepared_s": 0.0}
    shutil.rmtree(files["folder"], ignore_errors=True)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, _, _ = build(kind, args.tiny, args.device)
    model.save_pretrained(files["checkpoint"])
    build_slab_from_module(model, os.path.dirname(files["slab"]), kind, kind, progress=False,
                           compare_quantizers=False, print_report=False)
    open(os.path.join(files["folder"], "done"), "w").close()
    return {"prepared_s": round(time.perf_counter() - t0, 1)}


def child_from_files(args, kind: str, precision: str, regional: bool) -> dict:
    """A `:files` row: the model built on the meta device, offloaded from its checkpoint and INT8 slab on disk
    (`keep_full="file"`: the full-precision weights stay views of the mapped checkpoint), then peft LoRA."""
    import peft
    import torch
    from models import LORA_TARGETS, flux_config, flux_inputs, qwen_config, qwen_inputs

    import torch_stagehand as stagehand

    if precision != "int8":
        raise SystemExit(f"start_time: a :files row streams the slab's INT8 copies, not {precision}")
    files = _files_of(kind, args.tiny)
    cuda = args.device == "cuda"
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    from accelerate import init_empty_weights

    with init_empty_weights():  # parameters on the meta device, buffers real (as from_pretrained builds it)
        if kind == "flux":
            from diffusers import FluxTransformer2DModel

            model = FluxTransformer2DModel(**flux_config(args.tiny)).to(torch.bfloat16)
        else:
            from transformers import Qwen2ForCausalLM

            model = Qwen2ForCausalLM(qwen_config(args.tiny, "32b" if kind == "qwen32" else "7b")).to(torch.bfloat16)
    inputs, shape = (flux_inputs(flux_config(args.tiny), args.tiny, args.device) if kind == "flux"
                     else qwen_inputs(qwen_config(args.tiny), args.tiny, args.device))  # (32b: the same vocabulary)
    out: dict = {"row": args.row, "mode": args.mode, "shape": shape, "build_s": round(time.perf_counter() - t0, 1),
                 "page_cache": args.page_cache}
    model.requires_grad_(False)  # LoRA: the base is frozen before offload (a weight that trains gets a host gradient)
    from torch_stagehand.runtime.config import Config

    out["slab_reads"], out["rows_behind"] = args.slab_reads, args.rows_behind
    rt = timed_offload(args, out, model, precision="int8", checkpoint=files["checkpoint"], slab=files["slab"],
                       keep_full="file", vram_budget=None if args.tiny else BUDGETS[kind],
                       config=Config(slab_reads=args.slab_reads, slab_rows_behind=args.rows_behind == "on"))
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS[kind]))
    model.to(args.device)  # the adapters peft put beside the host weights (the streamed weights stay)
    return run_steps(args, kind, model, inputs, rt, out, regional)


def _blocks_of(kind: str, model) -> list:
    base = model.get_base_model()
    if kind == "flux":
        return [*base.transformer_blocks, *base.single_transformer_blocks]
    return list(base.model.layers)


def caches(row: str, mode: str) -> dict[str, str]:
    """The cache folders of one run: per row; cold empties them all, bundle keeps stagehand's alone."""
    base = os.path.join(ROOT, row.replace(":", "-"))
    env = {"STAGEHAND_CACHE_DIR": os.path.join(base, "stagehand"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(base, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(base, "triton")}
    wipe = {"cold": list(env.values()), "serial": list(env.values()), "coldprofile": list(env.values()),
            "warm": [], "profile": [],
            "bundle": [env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"]]}
    for folder in wipe[mode]:
        shutil.rmtree(folder, ignore_errors=True)
    return env


def drop_page_cache() -> str:
    """Empty the kernel's page cache (root only), so a cold `:files` run reads its files from the disk."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return "dropped"
    except OSError as e:
        return f"kept (could not drop it: {e.strerror})"


def bytecode_env(args) -> dict[str, str]:
    """With `--bytecode-cache`: Python's compiled bytecode kept under ROOT (PYTHONPYCACHEPREFIX). An installed
    torch has its `.pyc` files (pip writes them); a read-only environment without them (the device machines')
    compiles the source of every module it imports, in every process: 1.5 s of a warm Flux start."""
    return {"PYTHONPYCACHEPREFIX": os.path.join(ROOT, "pycache")} if args.bytecode_cache else {}


def prime_bytecode(args) -> dict:
    """Compile the bytecode of torch, Triton, transformers, diffusers, peft and stagehand into the cache once, as
    an install does, before any measured run."""
    import importlib.util

    roots = [os.path.dirname(importlib.util.find_spec(name).origin)
             for name in ("torch", "triton", "transformers", "diffusers", "peft", "torch_stagehand")
             if importlib.util.find_spec(name) is not None]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *roots], env=dict(os.environ,
                          **bytecode_env(args)), capture_output=True, text=True, timeout=args.timeout)
    return {"roots": roots, "seconds": round(time.perf_counter() - t0, 1), "exit": done.returncode}


def run_one(args, row: str, mode: str) -> dict:
    files = ":files" in row
    page_cache = drop_page_cache() if files and mode == "cold" and args.drop_page_cache else "as left"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--row", row, "--mode", mode, "--device", args.device,
           "--steps", str(args.steps), "--page-cache", page_cache, "--slab-reads", args.slab_reads,
           "--rows-behind", args.rows_behind, "--replans", str(args.replans)] + \
          (["--tiny"] if args.tiny else []) + \
          (["--profile-offload"] if args.profile_offload and mode == "cold" else []) + \
          (["--profile-first-step"] if mode in ("profile", "coldprofile") or (mode == "cold" and args.profile_cold)
           else []) + \
          (["--profile-dir", args.profile_dir] if args.profile_dir else []) + \
          ["--profile-steps", *map(str, args.profile_steps)] + \
          (["--trace-steps", *map(str, args.trace_steps)] if args.trace_steps else [])
    env = dict(os.environ, **caches(row, mode), **bytecode_env(args), STAGEHAND_TUNE_CACHE="1",
               STAGEHAND_COMPILE_CACHE="1", STAGEHAND_WARM_COMPILE_WORKERS="0" if args.cold_compile_workers else "1")
    # serial: the cold baseline, every unit compiled in the step, none ahead in workers (compiler/startup/ahead.py)
    env.pop("STAGEHAND_AHEAD_WORKERS", None)  # the product's default (two on CUDA) unless --ahead-workers says
    if mode in ("serial", "coldprofile"):
        env["STAGEHAND_AHEAD_WORKERS"] = "0"
    elif args.ahead_workers is not None:
        env["STAGEHAND_AHEAD_WORKERS"] = str(args.ahead_workers)
    print(f"start_time: {row} {mode} ...", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if os.environ.get("STAGEHAND_AHEAD_DEBUG") == "1" and args.out:  # the workers' and this side's cache keys
        with open(f"{os.path.splitext(args.out)[0]}_{row.replace(':', '-')}_{mode}.stderr", "w") as f:
            f.write(done.stderr)
    result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        return {"row": row, "mode": mode, "error": f"exit {done.returncode}: {done.stderr[-2000:]}",
                "process_s": round(wall, 1)}
    return dict(result, process_s=round(wall, 1))


def _rows_behind(r: dict) -> str:
    """A slab's rows read behind offload: their seconds from the reads' start, and the first step's wait for them."""
    behind = r.get("slab_rows_behind")
    return "" if not behind else f"reads {behind['reads_s']:.1f}s, waited {behind['waited_s']:.1f}s"


def _replan_ratio(r: dict) -> str:
    """`--replans`: the new-plan steps over the steady ones, median (max) of the rounds."""
    rounds = r.get("replan_rounds")
    return "" if not rounds else f"{rounds['median_ratio']:.3f} ({rounds['max_ratio']:.3f})"


def table_rows(results: list[dict]) -> list[dict]:
    cold = {r["row"]: r for r in results if r.get("mode") == "cold"}
    # A coldprofile run whose first step ran without the profiler is a serial run too.
    serial = {r["row"]: r for r in results if r.get("mode") == "serial" or (
        r.get("mode") == "coldprofile" and 0 not in r.get("profiled_steps", [0]))}
    out = []
    for r in results:
        if "error" in r:
            out.append({"row": r["row"], "mode": r["mode"], "error": r["error"][:80]})
            continue
        # The first loss against the cold run's compiled forward: the serial run's when measured (a cold run
        # with ahead-compile workers runs its first forward eagerly: within rounding, not bitwise).
        base = serial.get(r["row"]) or cold.get(r["row"])
        base = base if base is not None and "first_loss" in base else None  # a failed run: nothing to hold against
        out.append({
            "row": r["row"], "mode": r["mode"], "process_s": r["process_s"], "offload_s": r.get("offload_s", ""),
            "first_step_s": r["first_step_s"],
            # what a user waits for: offload and the first step (a slab's rows read behind offload end in the step)
            "to_first_step_end_s": round(r["offload_s"] + r["first_step_s"], 2) if "offload_s" in r else "",
            "rows_behind": _rows_behind(r), "replan_ratio": _replan_ratio(r), "dynamo_s": r.get("dynamo_s", ""), "graphs": r.get("dynamo_graphs", ""), "steps_2_4_ms": " / ".join(f"{x:.0f}" for x in r["step_ms"][:3]),
            "steady_ms": r["steady_ms"], "units": r.get("compiled_units", ""), "loaded": r.get("units_loaded", ""),
            "cold_units": r.get("units_compiled_cold", ""), "compile_s": r.get("compile_seconds", ""),
            "autotune_s": r.get("autotune_seconds", ""),
            # 0 where bitwise the same (a warm run against its cold one); a first forward run eagerly: rounding
            "loss_vs_cold": "" if base is None or r is base else
            f"{abs(r['first_loss'] - base['first_loss']) / max(abs(base['first_loss']), 1e-30):.1e}",
            "ahead": r.get("ahead_summary", ""),
            "vs_serial": (f"{r['first_step_s'] / serial[r['row']]['first_step_s']:.2f}x"
                          if r["mode"] == "cold" and r["row"] in serial else ""),
        })
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=["qwen:int8", "qwen:bf16", "qwen:resident"])
    p.add_argument("--modes", nargs="+", default=["cold", "warm"],
                   choices=["cold", "warm", "bundle", "profile", "serial", "coldprofile"],
                   help="profile: a warm run whose first step runs under cProfile (where its seconds go; slower); "
                        "coldprofile: the same of a serial cold run (where a cold compile's seconds go); "
                        "serial: a cold run without ahead-compile workers (the baseline of cold)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--timeout", type=int, default=540)
    p.add_argument("--cold-compile-workers", action="store_true",
                   help="do not start Inductor's compile workers at offload (STAGEHAND_WARM_COMPILE_WORKERS=0; "
                        "the default starts them)")
    p.add_argument("--ahead-workers", type=int, default=None,
                   help="processes compiling foreseen variants ahead (STAGEHAND_AHEAD_WORKERS; unset: the "
                        "default, two on CUDA; serial runs: 0)")
    p.add_argument("--slab-reads", default="auto", choices=["auto", "process", "threads"],
                   help="Config.slab_reads of a row from files: who reads the slab's rows")
    p.add_argument("--replans", type=int, default=0,
                   help="after the steps, this many rounds of rt.replan(), the steps that measure the new plan and "
                        "3 steady steps (their ratio: replan_rounds in the JSON)")
    p.add_argument("--rows-behind", default="on", choices=["on", "off"],
                   help="Config.slab_rows_behind of a row from files: the reader process's reads go on after offload "
                        "returns (the first fetch waits for them), or offload waits for every row")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--profile-offload", action="store_true",
                   help="cold runs profile their offload (cProfile: its top calls in the JSON; the offload's seconds "
                        "are then the profiler's)")
    p.add_argument("--profile-first-step", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile-cold", action="store_true",
                   help="cold runs (with their ahead-compile workers) run `--profile-steps` under cProfile too: where "
                        "the main process's seconds go while workers compile (a diagnosis run: those steps' times "
                        "are the profiler's)")
    p.add_argument("--profile-dir", default=None, help="a profile run writes the whole profile of each step it "
                   "profiles here (pstats files)")
    p.add_argument("--profile-steps", nargs="+", type=int, default=[0],
                   help="the steps a profile run profiles, from 0 (1: a cold run's calibration step; the plan made "
                        "from it runs from 2)")
    p.add_argument("--trace-steps", nargs="+", type=int, default=[],
                   help="a cold run traces these steps (from 0, and the ones between) with torch.profiler: GPU busy "
                        "time and idle gaps per step, top ops (slower: those steps' times are the profiler's)")
    p.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--page-cache", default="as left", help=argparse.SUPPRESS)
    p.add_argument("--bytecode-cache", action="store_true",
                   help="keep Python's bytecode under the cache root, compiled once before the runs (bytecode_env)")
    p.add_argument("--drop-page-cache", action="store_true",
                   help="before a cold :files run, empty the page cache (root) so the files come from the disk")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.child:
        result = prepare_files(args, args.row.split(":")[0]) if args.prepare else child(args)
        print("RESULT " + json.dumps(result, default=str), flush=True)
        return 0
    from _common import env_info, print_header, print_table, write_json

    env = print_header(env_info())
    bytecode = None
    if args.bytecode_cache:
        print("start_time: compiling the packages' bytecode into the cache (once, as an install does) ...", flush=True)
        bytecode = prime_bytecode(args)
    # A resident row has no compile bundle: its "bundle" run would be a second cold one.
    results: list[dict] = []
    prepared: dict[str, dict] = {}
    for row in args.rows:
        kind = row.split(":")[0]
        if ":files" in row and kind not in prepared:  # the checkpoint and slab on disk, once per model
            print(f"start_time: writing {kind}'s checkpoint and INT8 slab (once) ...", flush=True)
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--prepare", "--row", row,
                                   "--device", args.device] + (["--tiny"] if args.tiny else []),
                                  env=dict(os.environ, **bytecode_env(args)), capture_output=True, text=True,
                                  timeout=args.timeout)
            prepared[kind] = next((json.loads(line[7:]) for line in done.stdout.splitlines()
                                   if line.startswith("RESULT ")), {"error": done.stderr[-2000:]})
            if "error" in prepared[kind]:
                results.append({"row": row, "mode": "prepare", "error": prepared[kind]["error"]})
                continue
        for mode in args.modes:
            if mode == "bundle" and row.endswith(":resident"):
                continue  # a resident row has no compile bundle: its "bundle" run would be a second cold one
            results.append(run_one(args, row, mode))
            if args.out:  # after every run: a call cut at its time limit keeps the runs it made
                write_json(args.out, {"env": env, "budgets": BUDGETS, "steps": args.steps, "files_prepared": prepared,
                                      "bytecode_cache": bytecode,
                                      "warm_compile_workers": not args.cold_compile_workers,
                                      "ahead_workers": args.ahead_workers, "slab_reads": args.slab_reads,
                                      "rows_behind": args.rows_behind,
                                      "rows": table_rows(results), "runs": results})
    print_table(table_rows(results), title="seconds to the first step (each run a fresh process)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
