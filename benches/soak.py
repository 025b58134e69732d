"""Soak: thousands of LoRA steps of a full-size model, the budget changed and the precision map switched as it
runs, then device memory taken away mid-run, then restore(); every step recorded.

    python benches/soak.py                          # Qwen2.5-7B shape, int8, T=2048, 2000 steps (an H100)
    python benches/soak.py --tiny --device cpu      # the same run in miniature (a minute)

The run (one process, one model):
- `--steps` steps; every `--every` steps the budget moves to the next of `--budgets` (24 -> 12 -> 8 -> 16 GiB,
  round again) through `rt.replan(vram_budget=...)`; every `--switch-every` steps the precision map changes: a
  window of `--switch-blocks` blocks goes to bf16 and the rest back to int8, moving along the model each time
  (`rt.set_precision`, what the selective-precision policy calls when it moves blocks; scripted here so both
  visits of a budget see the same maps);
- each step is timed to its loss on the host (`loss.item()`, after the optimizer), and a JSONL line records
  the step: ms, loss, host RSS, page-locked bytes, GPU allocated / reserved, the plan, the map, recoveries;
- per budget visit: p50 / p99 of the settled steps (not the `--settle` steps after a budget change or a
  switch: a new plan measures its blocks there) and the memory at its end; the second visit of each budget is
  compared with the first (growth beyond noise fails the flatness column);
- out of memory (CUDA): a second process takes all but `--room-gib` of the device between two steps, then
  `torch.cuda.set_per_process_memory_fraction` caps this one; each is followed by steps that must recover
  (re-plan, run the block again) with the loss still finite; the warnings and `stats()["oom_recoveries"]`
  are kept;
- `rt.restore()`, then the page-locked bytes of the store's arenas and the GPU memory once the model is gone.

Writes <name>.jsonl (steps), <name>.json (summary) and <name>.png under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, CollectorClock, env_info, print_header, print_table, proc_status, write_json  # noqa: E402
from models import LORA_TARGETS, build_qwen  # noqa: E402

import torch_stagehand as stagehand  # noqa: E402
from torch_stagehand.config import Config  # noqa: E402

GIB = 2**30
# A second process that holds device memory until its stdin closes (the "other job" of the OOM phase).
HOG = ("import sys, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda'); "
       "print('ready', flush=True); sys.stdin.read()")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=250, help="steps between budget changes")
    ap.add_argument("--budgets", default="24,12,8,16", help="GiB (with --tiny: fractions of the streamed bytes)")
    ap.add_argument("--switch-every", type=int, default=50)
    ap.add_argument("--switch-blocks", type=int, default=4)
    ap.add_argument("--settle", type=int, default=4, help="steps after a change left out of p50 / p99")
    ap.add_argument("--gc-freeze-at", type=int, default=None,
                    help="gc.freeze() before this step (default: the start of the second round of budgets); -1: never")
    ap.add_argument("--rules-off-at", type=int, default=-1,
                    help="diagnosis: before this step the Conductor's backward-pressure and contention rules stop firing")
    ap.add_argument("--expandable-segments", action="store_true",
                    help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for this run (set before CUDA starts)")
    ap.add_argument("--room-gib", type=float, default=10.0, help="what the OOM phase leaves this process")
    ap.add_argument("--oom-steps", type=int, default=4)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--name", default=None)
    ap.add_argument("--summarize", default=None, metavar="JSONL",
                    help="no run: the table, JSON and PNG of a run's steps (one cut short keeps its JSONL)")
    args = ap.parse_args(argv)
    args.name = args.name or ("soak_tiny" if args.tiny else "soak_qwen7b")
    if args.gc_freeze_at is None:
        args.gc_freeze_at = args.every * len(args.budgets.split(","))
    if args.expandable_segments:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return args


class Recorder:
    """The per-step JSONL (appended line by line: a killed run keeps every step before it) and the rows. Its
    first line is the run's environment (`{"env": ...}`: commit, tree, device), so the steps say which code ran."""

    def __init__(self, path: str, env: dict):
        self.path, self.rows = path, []
        self._file = open(path, "a", buffering=1)
        self._file.write(json.dumps({"env": env}) + "\n")

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


def memory_now(rt, device: torch.device) -> dict:
    host = rt.stats()["host"]
    row = {"rss_gb": round(proc_status().get("VmRSS", 0) / 1e9, 3),
           "pinned_gb": round(host["pinned_locked_bytes"] / 1e9, 3)}
    if device.type == "cuda":
        row.update(gpu_alloc_gb=round(torch.cuda.memory_allocated(device) / 1e9, 3),
                   gpu_reserved_gb=round(torch.cuda.memory_reserved(device) / 1e9, 3))
    return row


def switch_map(n: int, k: int, turn: int) -> dict[int, str]:
    """`k` blocks in bf16 from block `turn * k` on (wrapping), the rest int8."""
    start = (turn * k) % n
    window = {(start + i) % n for i in range(k)}
    return {b: "bf16" if b in window else "int8" for b in range(n)}


def build(args, device: torch.device):
    import peft

    model, inputs, shape = build_qwen(args.tiny, str(device))
    model.requires_grad_(False)
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS["qwen"]))
    return model, inputs, shape


def budget_bytes(args, rt_or_bytes) -> list[int]:
    values = [float(v) for v in args.budgets.split(",")]
    if not args.tiny:
        return [int(v * GIB) for v in values]
    return [max(4096, int(v * rt_or_bytes)) for v in values]


class GcClock:
    """Milliseconds the collector ran since the last read, and its oldest generation's runs (_common's clock)."""

    def __init__(self):
        self.clock = CollectorClock()
        self._ms, self._full = 0.0, 0

    def read(self) -> dict:
        ms, full = sum(self.clock.seconds) * 1e3, self.clock.counts[2]
        out = {"gc_ms": round(ms - self._ms, 2), "gc_full": full - self._full}
        self._ms, self._full = ms, full
        return out


GC = GcClock()


def step_once(compiled, optimizer, inputs, clock: dict | None = None) -> tuple[float, float]:
    """One step timed on the host to its loss; `clock` gets `host_ms` (until the step's work was issued) and, on
    CUDA, `gpu_ms` (events on the compute stream around the step, read after the loss: no extra wait)."""
    cuda = torch.cuda.is_available() and clock is not None
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    loss = compiled(**inputs).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    issued = time.perf_counter()
    if cuda:
        end.record()
    value = loss.item()  # waits for the step's work, the optimizer's included
    if clock is not None:
        clock["host_ms"] = round((issued - t0) * 1e3, 2)
        if cuda:
            clock["gpu_ms"] = round(start.elapsed_time(end), 2)
    return (time.perf_counter() - t0) * 1e3, value


def run_steps(args, rt, compiled, optimizer, inputs, rec: Recorder, budgets: list[int], device) -> None:
    n = len(rt.blocks)
    changed_at = 0
    for step in range(args.steps):
        events = []
        if step % args.every == 0:
            visit = step // args.every
            rt.replan(vram_budget=budgets[visit % len(budgets)]) if step else None
            events.append("budget")
            changed_at = step
        if step % args.switch_every == 0:
            rt.set_precision(switch_map(n, args.switch_blocks, step // args.switch_every))
            events.append("switch")
            changed_at = step
        if step == args.gc_freeze_at:
            gc.freeze()  # every object made so far out of the collector's reach: does the spread change?
            events.append("gc_freeze")
        if step == args.rules_off_at and rt.plan_driver.conductor.enabled:
            policy = rt.plan_driver.conductor.policy  # does the spread come from the rules' hints?
            policy.pressure_threshold, policy.contention_checks = math.inf, 2**62
            events.append("rules_off")
        GC.read()
        clock: dict = {}
        ms, loss = step_once(compiled, optimizer, inputs, clock)
        collected = GC.read()  # what the collector took inside this step's time
        stats = rt.stats()
        rec.add({"step": step, "phase": "soak", "visit": step // args.every,
                 "budget_gib": round(budgets[(step // args.every) % len(budgets)] / GIB, 6),
                 "ms": round(ms, 2), "loss": loss, "settled": step - changed_at >= args.settle, "events": events,
                 "resident_blocks": stats.get("resident_blocks"), "bf16_blocks": stats["precision_counts"].get("bf16", 0),
                 "oom_recoveries": len(stats["oom_recoveries"]), **clock, **collected, **memory_now(rt, device)})
        if step % 50 == 0 or step == args.steps - 1:
            print(f"  step {step}/{args.steps}: {ms:.0f} ms, loss {loss:.4f}, budget "
                  f"{rec.rows[-1]['budget_gib']} GiB, resident {stats.get('resident_blocks')}, "
                  f"rss {rec.rows[-1]['rss_gb']} GB, gpu {rec.rows[-1].get('gpu_alloc_gb')} GB", flush=True)


def _share(slow: list[dict], key: str, test) -> int | None:
    """How many of the slow steps pass `test` (None when the run did not record `key`)."""
    return sum(bool(test(r)) for r in slow) if all(key in r for r in slow) else None


def visits(args, rows: list[dict]) -> list[dict]:
    """Per budget visit: settled p50 / p99 and the memory at its end."""
    out = []
    for visit in sorted({r["visit"] for r in rows}):
        mine = [r for r in rows if r["visit"] == visit]
        settled = sorted(r["ms"] for r in mine if r["settled"])
        p50 = statistics.median(settled) if settled else float("nan")
        p99 = settled[min(len(settled) - 1, math.ceil(0.99 * len(settled)) - 1)] if settled else float("nan")
        end = mine[-1]
        slow = [r for r in mine if r["settled"] and r["ms"] > 1.15 * p50]  # over the target's ratio
        gpu = [r["gpu_ms"] for r in mine if r["settled"] and "gpu_ms" in r]
        gpu_p50 = statistics.median(gpu) if gpu else float("nan")
        out.append({"visit": visit, "budget_gib": end["budget_gib"], "steps": len(mine), "settled": len(settled),
                    "gc_frozen": any(r["step"] >= args.gc_freeze_at >= 0 for r in mine),
                    "slow_steps": len(slow), "slow_with_full_gc": _share(slow, "gc_full", lambda r: r["gc_full"] > 0),
                    "slow_on_the_gpu": _share(slow, "gpu_ms", lambda r: r["gpu_ms"] > 1.15 * gpu_p50),
                    "p50_ms": round(p50, 1), "p99_ms": round(p99, 1), "p99_over_p50": round(p99 / p50, 3),
                    "max_ms": round(max(r["ms"] for r in mine), 1), "rss_gb": end["rss_gb"], "pinned_gb": end["pinned_gb"],
                    "gpu_alloc_gb": end.get("gpu_alloc_gb"), "gpu_reserved_gb": end.get("gpu_reserved_gb"),
                    "resident_blocks": end["resident_blocks"]})
    per_budget = len(args.budgets.split(","))
    for v in out:  # the same budget's earlier visit: memory must not have grown beyond noise
        before = next((u for u in out if u["visit"] == v["visit"] - per_budget), None)
        if before is not None:
            v["rss_growth_gb"] = round(v["rss_gb"] - before["rss_gb"], 3)
            v["pinned_growth_gb"] = round(v["pinned_gb"] - before["pinned_gb"], 3)
            if v.get("gpu_alloc_gb") is not None:
                v["gpu_growth_gb"] = round(v["gpu_alloc_gb"] - before["gpu_alloc_gb"], 3)
    return out


def oom_phase(args, rt, compiled, optimizer, inputs, rec: Recorder, device) -> list[dict]:
    """Memory taken away between steps, twice; each time the next steps must recover."""
    events = []

    def steps(label: str) -> None:
        """`--oom-steps` steps as a training loop runs them: a step that raises out of memory (its backward could
        not run again inside it) is run again with the same batch, as a loop that catches the error would; the
        runtime dropped its partial gradients and re-planned at the rerun's forward."""
        raised = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(args.oom_steps):
                before = len(rt.stats()["oom_recoveries"])
                row = {"step": len(rec.rows), "phase": label, "settled": False, "events": [], "ms": None, "loss": None}
                for attempt in range(3):
                    try:
                        ms, loss = step_once(compiled, optimizer, inputs)
                        row.update(ms=round(ms, 2), loss=loss, attempts=attempt + 1)
                        break
                    except torch.OutOfMemoryError as e:
                        raised.append(str(e).splitlines()[0])
                        row.update(raised=raised[-1])
                recs = rt.stats()["oom_recoveries"][before:]
                rec.add({**row, "oom_recoveries": len(recs), **memory_now(rt, device)})
                print(f"  {label} step {i}: {row['ms']} ms, loss {row['loss']}, recoveries {len(recs)}"
                      + (f", raised {row['raised'][:120]}; run again: {'done' if row['loss'] is not None else 'raised'}"
                         if "raised" in row else ""), flush=True)
        said = [str(w.message) for w in caught if "memory" in str(w.message)]
        for message in said:  # the run's log keeps what the runtime said (the JSON keeps it whole)
            print(f"    {message[:400]}", flush=True)
        done = [r for r in rec.rows if r["phase"] == label and r["loss"] is not None]
        events.append({"phase": label, "warnings": said,
                       "raised": raised, "steps_done": len(done), "plan_after": rt.plan.summary(),
                       "losses_finite": all(math.isfinite(r["loss"]) for r in done)})

    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()  # this process hands back its cached blocks: what it needs now is allocated
    free, _ = torch.cuda.mem_get_info(device)
    room_now = torch.cuda.memory_reserved(device)
    take = int(free - max(0, args.room_gib * GIB - room_now) - 0.6 * GIB)  # the hog's own context: ~0.6 GiB
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(take)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    assert hog.stdout.readline().strip() == "ready", "the second process could not take the memory"
    print(f"  another process holds {take / GIB:.1f} GiB; this one has {room_now / GIB:.1f} GiB reserved", flush=True)
    try:
        steps("oom_other_process")
    finally:
        hog.stdin.close()
        hog.wait()
    rt.replan(vram_budget=budget_bytes(args, 0)[-1])
    fraction = args.room_gib * GIB / total
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    print(f"  memory fraction {fraction:.3f} ({args.room_gib} GiB)", flush=True)
    try:
        steps("oom_memory_fraction")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    rt.replan(vram_budget=budget_bytes(args, 0)[-1])
    steps("after_oom")
    return events


def figure(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(12, 11), sharex=True)
    x = [r["step"] for r in rows]
    nan = float("nan")  # a step that raised has no time and no loss
    axes[0].plot(x, [nan if r["ms"] is None else r["ms"] for r in rows], lw=0.6)
    axes[0].set_ylabel("step ms")
    axes[0].set_yscale("log")
    ax = axes[0].twinx()
    ax.step(x, [r.get("budget_gib", float("nan")) for r in rows], color="tab:red", lw=1, where="post")
    ax.set_ylabel("budget GiB", color="tab:red")
    axes[1].plot(x, [r["rss_gb"] for r in rows], label="host RSS GB")
    axes[1].plot(x, [r["pinned_gb"] for r in rows], label="page-locked GB")
    axes[1].legend(loc="center right")
    if "gpu_alloc_gb" in rows[0]:
        axes[2].plot(x, [r["gpu_alloc_gb"] for r in rows], label="GPU allocated GB (after the step)")
        axes[2].plot(x, [r["gpu_reserved_gb"] for r in rows], label="GPU reserved GB")
        axes[2].legend(loc="center right")
    axes[3].plot(x, [nan if r["loss"] is None else r["loss"] for r in rows], lw=0.6)
    axes[3].set_ylabel("loss")
    axes[3].set_xlabel("step")
    for r in rows:
        if r["oom_recoveries"]:
            for a in axes:
                a.axvline(r["step"], color="tab:orange", lw=0.8, alpha=0.6)
    fig.suptitle("soak: budget changes, precision switches, out-of-memory injections (orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def run_env(log: str) -> dict:
    """The environment of the run that wrote `log` (its first line: print_header's `key=value | ...`), not this
    process's: the summary is made elsewhere."""
    with open(log) as f:
        first = f.readline().strip()
    env = dict(part.split("=", 1) for part in first.split(" | ") if "=" in part)
    if "torch" not in env:
        raise SystemExit(f"{log}: its first line is not the run's header (print_header): {first[:80]!r}")
    return env


def telemetry_check(path: str, soak_rows: list[dict]) -> dict:
    """The runtime's telemetry beside a run's steps (gzipped, as the device run brings it back): one record a
    step, none missing. Nothing when the run left none."""
    if not os.path.exists(path):
        return {}
    import gzip

    with gzip.open(path, "rt") as f:
        ids = [json.loads(line)["step_id"] for line in f if line.strip()]
    return {"telemetry_file": os.path.basename(path), "telemetry_records": len(ids),
            "telemetry_complete": ids == list(range(len(ids))) and len(ids) >= len(soak_rows)}


def read_steps(path: str) -> list[dict]:
    """A run's step records (its JSONL without the environment line)."""
    with open(path) as f:
        return [row for row in (json.loads(line) for line in f if line.strip()) if "step" in row]


def summarize(args, path: str) -> int:
    """The summary of a run that was cut before it wrote one, from its steps alone."""
    rows = read_steps(path)
    soak_rows = [r for r in rows if r["phase"] == "soak"]
    table = visits(args, soak_rows)
    print_table(table, title=f"per budget visit (settled steps), from {path}")
    stem = os.path.splitext(path)[0]
    write_json(stem + ".json", {"env": run_env(stem + ".log"), "args": vars(args), "from_jsonl": os.path.basename(path),
                                "steps_run": len(rows), "visits": table, "cut_short": True,
                                **telemetry_check(stem + "_telemetry.jsonl.gz", soak_rows),
                                "losses_finite": all(math.isfinite(r["loss"]) for r in rows if r["loss"] is not None),
                                "switches": sum("switch" in r["events"] for r in soak_rows),
                                "worst_p99_over_p50": max(v["p99_over_p50"] for v in table)})
    figure(rows, stem + ".png")
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    if args.summarize:
        return summarize(args, args.summarize)
    device = torch.device(args.device if torch.cuda.is_available() or args.device == "cpu" else "cpu")
    os.makedirs(args.out, exist_ok=True)
    info = print_header()
    t0 = time.perf_counter()
    model, inputs, shape = build(args, device)
    telemetry = os.path.join(args.out, f"{args.name}_telemetry.jsonl")
    if os.path.exists(telemetry):
        os.remove(telemetry)
    first = [float(v) for v in args.budgets.split(",")][0]
    config = Config(telemetry_file=telemetry)
    rt = stagehand.offload(model, device=device, precision="int8", keep_full="ram", config=config,
                           vram_budget=None if args.tiny else int(first * GIB))
    budgets = budget_bytes(args, sum(rt.store.nbytes(b, "bf16") for b in range(len(rt.blocks))))
    if args.tiny:
        rt.replan(vram_budget=budgets[0])
    offload_s = time.perf_counter() - t0
    compiled = torch.compile(model, backend="stagehand", options={"inner": "inductor" if device.type == "cuda" else "eager"})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    rt.attach(optimizer)
    jsonl = os.path.join(args.out, f"{args.name}.jsonl")
    if os.path.exists(jsonl):
        os.remove(jsonl)
    rec = Recorder(jsonl, info)
    run_steps(args, rt, compiled, optimizer, inputs, rec, budgets, device)
    oom = oom_phase(args, rt, compiled, optimizer, inputs, rec, device) if device.type == "cuda" else []
    rec.close()
    table = visits(args, [r for r in rec.rows if r["phase"] == "soak"])
    print_table(table, title="per budget visit (settled steps)")
    stats, allocator = rt.stats(), rt.allocator
    with open(telemetry) as f:
        ids = [json.loads(line)["step_id"] for line in f if line.strip()]
    arenas = list(rt.store.arenas)
    locked_before = sum(a.locked_bytes for a in arenas)
    rt.restore()
    del compiled, optimizer, rt
    model = None
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    after = {"pinned_locked_bytes": sum(a.locked_bytes for a in arenas), "pinned_locked_before": locked_before,
             **({"gpu_allocated_bytes": torch.cuda.memory_allocated(device)} if device.type == "cuda" else {})}
    print(f"  restore(): page-locked {locked_before / 1e9:.2f} GB -> {after['pinned_locked_bytes'] / 1e9:.2f} GB"
          + (f"; GPU allocated with the model gone {after['gpu_allocated_bytes'] / 1e6:.1f} MB"
             if device.type == "cuda" else ""), flush=True)
    soak_rows = [r for r in rec.rows if r["phase"] == "soak"]
    result = {
        "env": info, "args": vars(args), "shape": shape, "offload_s": round(offload_s, 1),
        "visits": table, "oom": oom, "oom_recoveries": stats["oom_recoveries"],
        "telemetry_records": len(ids), "steps_run": len(rec.rows),
        # one record a step, none missing (a step that raised in its forward never ended: it has none)
        "telemetry_complete": ids == list(range(len(ids))) and len(ids) >= len(soak_rows),
        "losses_finite": all(math.isfinite(r["loss"]) for r in rec.rows if r["loss"] is not None),
        "switches": sum("switch" in r["events"] for r in soak_rows),
        "worst_p99_over_p50": max(v["p99_over_p50"] for v in table),
        "restore": after, "plan_corrections": stats["plan_corrections"], "allocator": allocator,
        "gc_freezes": stats["gc_freezes"],
    }
    write_json(os.path.join(args.out, f"{args.name}.json"), result)
    figure(rec.rows, os.path.join(args.out, f"{args.name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
