"""The figures README.md and docs/ quote, generated from the files that hold them.

A document quotes a figure through a generated block:

    <!-- figures:NAME -->
    ...what FIGURES[NAME] gives, written by --write...
    <!-- /figures:NAME -->

    python benches/figures.py            # --check (the default): exit 1 naming every block that differs from what
                                         # its files give now, every unknown or unclosed block, and every cited
                                         # benches/results/... path that does not exist
    python benches/figures.py --write    # regenerate every block in README.md and docs/**/*.md (`make figures`)
    python benches/figures.py --list     # the registry: each figure and the files it reads
    python benches/figures.py --show NAME

Every figure is a function that reads result files under benches/results/ and returns markdown: a caption line
naming its source file(s) and the run's environment as the file records it (GPU, torch, the run's date, the commit
when the file records one), then a table. Columns are optional: a column appears when some row has its field, so a
newer file with more fields (a `resident (inductor)` baseline beside `resident (eager)`, `peak_reserved_gib`,
`first_step_s`, a `resident int8` row) shows them with no change here. Ratios to the resident model are taken here,
from the rows of the same file: `step_ms / step_ms` of its resident (eager) and resident (inductor) rows.

Two figures are not read from files: `offload_report` runs the quick start's `offload` and its first training step
on the CPU and quotes what they print (compared with times normalised: they vary from run to run), and
`demo_shapes` reads the demo's shapes from its code.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benches" / "results"
REL = "benches/results"
BLOCK = re.compile(r"<!-- figures:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /figures:(?P=name) -->", re.S)
OPENER = re.compile(r"<!-- (/?)figures:([\w.-]+) -->")
CITED = re.compile(r"benches/results/[\w.*<>-]+(?:/[\w.-]+)*")
SECONDS = re.compile(r"\d+(?:\.\d+)? s\b")
PHASES = re.compile(r"first step took N s \([^)]*\)")
STAGES = re.compile(r"^  took N s \(.*\)$", re.M)  # offload's summary line: the stages over 0.05 s


# ---- reading result files ------------------------------------------------------------------------------------------


def load(name: str):
    """A result file: JSON, or JSON lines (each line that is a JSON object; other lines are the run's log)."""
    path = RESULTS / name
    text = path.read_text()
    if name.endswith(".jsonl"):
        records = {}
        for line in text.splitlines():
            if line.startswith("{"):
                records.update(json.loads(line))
        return records
    return json.loads(text)


def env_of(data: dict) -> dict:
    return data.get("env") or {}


def env_words(env: dict) -> str:
    """GPU (or CPU), torch, the run's date, the commit: as the file records them."""
    device = env.get("device") or env.get("gpu")
    if device in (None, "cpu"):
        threads = env.get("cpu_threads")
        device = "CPU" + (f" ({threads} threads)" if threads else "")
    words = [device, f"torch {env['torch']}" if env.get("torch") else "torch not recorded"]
    if env.get("time_utc"):
        words.append(f"run {env['time_utc'][:10]}")
    commit = env.get("commit")
    if commit and commit != "unknown":
        tree = env.get("tree")
        words.append(f"commit {commit[:12]}" + (f" ({tree} tree)" if tree and tree != "unknown" else ""))
    else:
        words.append("commit not recorded")
    return ", ".join(words)


def cite(name: str) -> str:
    """`benches/results/NAME`, and its log beside it when the run wrote one."""
    log = Path(name).with_suffix(".log").name
    extra = f" (log `{REL}/{log}`)" if log != name and (RESULTS / log).exists() else ""
    return f"`{REL}/{name}`{extra}"


def caption(*names: str, what: str = "") -> str:
    """One line: what the table is, then each source file with its run's environment."""
    envs = [(n, env_words(env_of(load(n)))) for n in names]
    if len({e for _, e in envs}) == 1:
        sources = ", ".join(cite(n) for n, _ in envs) + f": {envs[0][1]}"
    else:
        sources = "; ".join(f"{cite(n)}: {e}" for n, e in envs)
    return (f"{what.rstrip('.')}. " if what else "") + f"Source{'s' * (len(names) > 1)}: {sources}."


# ---- formatting ----------------------------------------------------------------------------------------------------


def ms(v) -> str:
    if v is None or v == "":
        return ""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"


def num(v, digits: int = 2) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}f}"


def pct(v, digits: int = 1) -> str:
    return "" if v is None else f"{v:+.{digits}f}%"


@dataclass
class Col:
    header: str
    cell: Callable[[dict], str]


def table(rows: list[dict], cols: list[Col]) -> str:
    """A markdown table; a column whose cells are all empty is left out (fields a file does not have)."""
    cells = [[str(c.cell(r) if c.cell(r) is not None else "") for c in cols] for r in rows]
    keep = [i for i in range(len(cols)) if any(row[i] != "" for row in cells)]
    lines = ["| " + " | ".join(cols[i].header for i in keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(row[i].replace("|", "\\|") for i in keep) + " |" for row in cells]
    return "\n".join(lines)


def field(key: str, fmt=num, *args) -> Callable[[dict], str]:
    return lambda r: fmt(r.get(key), *args) if r.get(key) is not None else ""


# ---- resident baselines and ratios ---------------------------------------------------------------------------------


def baseline_kind(row: dict) -> str | None:
    """"eager" or "inductor" for a resident baseline row, else None. Resident rows from before the compiled
    baseline existed ("resident", "resident ckpt", "resident eager") ran eagerly."""
    mode = row.get("mode", "")
    if not mode.startswith("resident") or "stagehand" in mode or not row.get("step_ms"):
        return None
    if row.get("baseline") in ("eager", "inductor"):
        return row["baseline"]
    return "inductor" if "inductor" in mode else "eager"


def baselines(rows: list[dict], group=lambda r: r.get("ckpt")) -> dict:
    """{(group, kind): row} of a file's resident baselines."""
    out = {}
    for r in rows:
        kind = baseline_kind(r)
        if kind is not None:
            out.setdefault((group(r), kind), r)
    return out


def ratio(row: dict, base: dict | None) -> str:
    if not base or not row.get("step_ms"):
        return ""
    return f"{row['step_ms'] / base['step_ms']:.2f}"


def ratio_cols(bases: dict, group=lambda r: r.get("ckpt"), label: str = "resident") -> list[Col]:
    """x resident (inductor) first, then x resident (eager): each row against the baseline of its own group."""
    return [Col(f"x {label} ({kind})", lambda r, k=kind: ratio(r, bases.get((group(r), k))))
            for kind in ("inductor", "eager")]


# ---- the budget sweeps ---------------------------------------------------------------------------------------------

MODELS = {
    "flux": "Flux-dev 12B (`FluxTransformer2DModel`)",
    "qwen": "Qwen2.5-7B shape (`Qwen2ForCausalLM`)",
}


def model_words(data: dict) -> str:
    shape = data.get("shape") or {}
    words = MODELS.get(data.get("model"), str(data.get("model", "")))
    if "image_tokens" in shape:
        words += f", {shape['image_tokens']} image + {shape['text_tokens']} text tokens"
    if "sequence" in shape:
        words += f", sequence {shape['sequence']}"
    if data.get("ckpt") is not None:
        words += f", the model's gradient checkpointing {'on' if data['ckpt'] else 'off'}"
    return words


def sweep_label(row: dict) -> str:
    mode = row.get("mode", "")
    mode = {"resident": "resident (eager)", "resident ckpt": "resident ckpt (eager)"}.get(mode, mode)
    mode = mode.replace("resident ckpt (", "resident, checkpointing on (")
    mode = mode.replace("two-slot (no budget)", "no budget (two slots)")
    m = re.fullmatch(r"budget ([\d.]+) GiB", mode)
    if m:
        mode = f"`vram_budget` {float(m.group(1)):g} GiB"
    return mode


def plan_blocks(row: dict, ckpt: bool) -> str:
    if "resident" not in row or row.get("step_ms") is None:
        return ""
    recomputed = "model's" if row.get("plan") == "fixed" and ckpt else row.get("recomputed")
    return f"{row['resident']} / {row['streamed']} / {recomputed}"


def predicted(row: dict) -> str:
    if row.get("pred_err") is None or row.get("predicted_ms") is None:
        return ""
    return f"{ms(row['predicted_ms'])} ({row['pred_err'] * 100:+.1f}%)"


def note(row: dict) -> str:
    error = row.get("error")
    if not error:
        return ""
    return error.removeprefix("planner: ").split(";")[0]


def sweep_cols(data: dict) -> list[Col]:
    rows, ckpt = data["rows"], bool(data.get("ckpt"))
    bases = baselines(rows)
    cols = [Col("setting", sweep_label), Col("step ms", field("step_ms", ms))]
    for on in (ckpt, not ckpt):  # the sweep's own checkpointing first; Qwen's sweep also has checkpointed baselines
        for kind in ("inductor", "eager"):
            base = bases.get((on, kind))
            header = f"x resident ({kind})" if on == ckpt else f"x resident, checkpointing {'on' if on else 'off'} ({kind})"
            cols.append(Col(header, lambda r, b=base: ratio(r, b)))
    return cols + [
        Col("peak GiB", field("peak_gib")),
        Col("peak reserved GiB", field("peak_reserved_gib")),
        Col("first step s", field("first_step_s", num, 1)),
        Col("first step peak GiB", field("first_step_peak_gib")),
        Col("first step reserved GiB", field("first_step_peak_reserved_gib")),
        Col("H2D GB / step", field("h2d_gb_step")),
        Col("D2H GB / step", lambda r: num(r["d2h_gb_step"]) if r.get("d2h_gb_step") else ""),
        Col("resident / streamed / recomputed blocks", lambda r: plan_blocks(r, ckpt)),
        Col("spilled blocks", lambda r: num(r["spilled"]) if r.get("spilled") else ""),
        Col("predicted ms (error)", predicted),
        Col("note", note),
    ]


def sweep(name: str) -> str:
    data = load(name)
    rows = data["rows"]
    h2d = (data.get("cost_model") or {}).get("h2d_bps")
    what = f"{model_words(data)}; LoRA r=16, AdamW, int8" + (f"; pinned H2D measured {h2d / 1e9:.1f} GB/s" if h2d else "")
    planned = [r for r in rows if r.get("under_budget") is not None]
    over = [sweep_label(r) for r in planned if not r["under_budget"]]
    after = ("Every plan's peak stayed under its budget." if planned and not over else
             f"Over their budget: {', '.join(over)}." if over else "")
    return f"{caption(name, what=what)}\n\n{table(rows, sweep_cols(data))}\n" + (f"\n{after}\n" if after else "")


def sweep_points(rows: list[dict]) -> list[dict]:
    """The budget rows that ran (not the resident int8 row: its budget is `vram_budget_gib`)."""
    return [r for r in rows if r.get("budget_gib") is not None and r.get("step_ms")]


def sweep_picks(data: dict) -> list[dict]:
    """Headline rows: the baselines at the sweep's checkpointing, no budget, the fastest and the smallest budget."""
    rows, ckpt = data["rows"], data.get("ckpt")
    picks = [r for r in rows if baseline_kind(r) and r.get("ckpt") == ckpt]
    picks += [r for r in rows if r.get("mode", "").startswith("two-slot")]
    points = sweep_points(rows)
    if points:
        for r in (min(points, key=lambda r: r["step_ms"]), min(points, key=lambda r: r["budget_gib"])):
            if r not in picks:
                picks.append(r)
    return picks


def headline_qwen() -> str:
    name = "budget_sweep_qwen.json"
    data = load(name)
    cols = [c for c in sweep_cols(data) if c.header in ("setting", "step ms", "peak GiB", "peak reserved GiB")
            or c.header.startswith("x resident")]
    return f"{caption(name, what=model_words(data) + ', int8')}\n\n{table(sweep_picks(data), cols)}\n"


# ---- models and peers ----------------------------------------------------------------------------------------------

MODE_WORDS = {
    "resident eager": "resident (eager)",
    "resident": "resident (eager)",
    "stagehand int8": "stagehand, all blocks int8",
    "stagehand bf16": "stagehand, all blocks bf16",
    "stagehand mixed": "stagehand, mixed (first and last two blocks bf16, the rest int8)",
    "diffusers group offload, num_blocks_per_group=1": "diffusers `enable_group_offload`, `block_level`, "
                                                       "`num_blocks_per_group=1`, `use_stream=True`",
    "diffusers group offload, num_blocks_per_group=4": "the same, asked for `num_blocks_per_group=4`",
    "accelerate cpu_offload": "accelerate `cpu_offload`",
}


def mode_words(row: dict) -> str:
    return MODE_WORDS.get(row.get("mode", ""), row.get("mode", ""))


def models_table() -> str:
    names = ["models_flux.json", "models_qwen.json"]
    rows = []
    for n in names:
        data = load(n)
        label = {"flux": "Flux 12B", "qwen": "Qwen 7B"}.get(data["model"], data["model"])
        rows += [dict(r, _model=label, _file=n) for r in data["rows"]]
    group = lambda r: (r["_file"], r.get("ckpt"))  # noqa: E731
    bases = baselines(rows, group)
    cols = [Col("model", lambda r: r["_model"]), Col("checkpointing", lambda r: "on" if r.get("ckpt") else "off"),
            Col("mode", mode_words), Col("step ms", field("step_ms", ms)), *ratio_cols(bases, group),
            Col("peak GiB", field("peak_gib")), Col("peak reserved GiB", field("peak_reserved_gib")),
            Col("H2D GB / step", field("h2d_gb_step")), Col("PCIe floor ms", field("floor_ms", ms)),
            Col("sync fetches / step", field("sync_fetches_step", num, 0)),
            Col("first step s", field("first_step_s", num, 1)), Col("note", note)]
    shapes = "; ".join(f"{model_words(dict(load(n), ckpt=None)).split(' (')[0]}, "
                       f"{model_words(dict(load(n), ckpt=None)).split(', ', 1)[1]}, {load(n).get('params_b')}B parameters"
                       for n in names)
    what = (f"{shapes}; LoRA r=16 on the attention projections, AdamW; PCIe floor = H2D bytes per step over the "
            "pinned H2D bandwidth measured in the run (" + " and ".join(f"{load(n).get('pinned_h2d_gbps')} GB/s"
                                                                        for n in names) + ")")
    return f"{caption(*names, what=what)}\n\n{table(rows, cols)}\n"


def first_step_table() -> str:
    names = ["models_qwen_firststep_run1.json", "models_qwen_firststep_run2.json"]
    rows = []
    for i, n in enumerate(names):
        for r in load(n)["rows"]:
            if r.get("first_step_parts_s"):
                rows.append(dict(r, _process=f"{i + 1}", **{f"_{k}": v for k, v in r["first_step_parts_s"].items()}))
    cols = [Col("process", lambda r: r["_process"]), Col("mode", mode_words),
            Col("first step s", field("first_step_s", num, 1)), Col("Dynamo capture s", field("_dynamo_capture", num, 1)),
            Col("AOTAutograd + Inductor s", field("_aot_inductor", num, 1)),
            Col("W8A16 autotuning s", field("_w8a16_autotune", num, 1)), Col("later steps ms", field("step_ms", ms))]
    what = ("The first step of a fresh process, Qwen2.5-7B shape, sequence 2048, checkpointing on, int8; "
            "two processes one after the other on the same machine")
    return f"{caption(*names, what=what)}\n\n{table(rows, cols)}\n"


def start_time_table(name: str = "start_time_mixed.json") -> str:
    """Seconds to the first step (benches/start_time.py): each run a fresh process, cold then warm."""
    data = load(name)
    runs = [r for r in data["runs"] if "error" not in r]
    cold = {r["row"]: r for r in runs if r["mode"] == "cold"}
    model = {"flux": "Flux-dev 12B", "qwen": "Qwen2.5-7B shape"}

    def same_loss(r: dict) -> str:
        base = cold.get(r["row"])
        if base is None or r is base:
            return ""
        diff = abs(r["first_loss"] - base["first_loss"]) / abs(base["first_loss"])
        return "the same" if diff == 0 else f"{diff:.1e} apart (another plan)"

    def units(r: dict) -> str:
        return f"{r['units_compiled_cold']} / {r['units_loaded']}" if "units_loaded" in r else ""

    cols = [Col("model", lambda r: model.get(r["row"].split(":")[0], r["row"])),
            Col("precision", lambda r: r["row"].split(":")[1]), Col("run", lambda r: r["mode"]),
            Col("offload s", field("offload_s", num, 1)), Col("first step s", field("first_step_s", num, 1)),
            Col("Dynamo capture s", field("dynamo_s", num, 1)),
            Col("units compiled / loaded in the run", units), Col("their s", field("compile_seconds", num, 1)),
            Col("W8A16 autotune s", field("autotune_seconds", num, 1)),
            Col("steps 2-4 ms", lambda r: " / ".join(ms(v) for v in r["step_ms"][:3])),
            Col("steady ms", field("steady_ms", ms)), Col("first loss against cold", same_loss),
            Col("cost model", lambda r: "kept, loaded" if "loaded from" in (r.get("cost_model_cache") or "")
                else "calibrated" if r.get("cost_model_cache") else "")]
    budgets = ", ".join(f"{model[k]} {v}" for k, v in data["budgets"].items())
    what = (f"Each run a fresh process (`benches/start_time.py`): the full-size model built on the GPU, LoRA r=16, "
            f"AdamW, `vram_budget` {budgets}; cold: every cache empty; warm: a second process on the same machine. "
            "Dynamo capture holds the backend's graph passes; units compile lazily as they first run, in the first "
            "step and in the step after the re-plan (steps 2-4 begin with it)")
    return f"{caption(name, what=what)}\n\n{table(runs, cols)}\n"


# The start-time runs after block-by-block compilation (each file one device call; the whole-model rows are
# start_time_mixed.json, before it): (file, rows taken from it).
START_TIME_SOURCES = (("start_time_mixed.json", ("flux:int8", "qwen:int8")),
                      ("start_time_flux_blocks.json", ("flux:int8:blocks", "flux:resident:blocks")),
                      ("start_time_files_final.json", ("flux:int8:files:blocks",)),
                      ("start_time_flux_files.json", ("flux:bf16:blocks",)),
                      ("start_time_qwen_blocks.json", ("qwen:int8:blocks", "qwen:resident:blocks")),
                      ("start_time_qwen32_blocks.json", ("qwen32:int8:blocks",)))


# This code's runs (fewer variants per block structure, resumed plans, the tuner's threads): (file, rows).
START_TIME_NOW = (("start_time_session_a.json", ("flux:int8:files:blocks", "flux:bf16:blocks", "qwen:int8:blocks")),
                  ("start_time_session_b.json", ("qwen32:int8:blocks",)))


def start_time_now_table() -> str:
    """Seconds to the first step, per block, with the code that shares a block structure's variants."""
    return start_time_blocks_table(START_TIME_NOW, (
        "Each run a fresh process (`benches/start_time.py --rows flux:int8:files:blocks flux:bf16:blocks "
        "qwen:int8:blocks qwen32:int8:blocks --drop-page-cache`), LoRA r=16, AdamW, `stagehand.compile_blocks`; "
        "`vram_budget` Flux 16 GiB, Qwen-7B 20 GiB, Qwen-32B 40 GiB; cold: every cache empty (the checkpoint + slab "
        "row's page cache dropped too); warm: a second process on the same machine. Step 2 of a cold run is the "
        "first under the plan made from the calibration step"))


def start_time_bytecode_table() -> str:
    """The same, with Python's bytecode cached as an install leaves it (start_time.py --bytecode-cache)."""
    return start_time_blocks_table((("start_time_session_bytecode.json", ("flux:int8:files:blocks", "flux:bf16:blocks")),), (
        "As the table above (`--rows flux:int8:files:blocks flux:bf16:blocks --drop-page-cache --bytecode-cache`), "
        "with Python's bytecode cached as an install leaves it: the device's environment gave Python no usable "
        "`.pyc` files, so every process compiled the source of each module it imported (1.6 s of a warm Flux "
        "first step built in memory, where Inductor is first imported); `--bytecode-cache` compiles it once into "
        "a cache under the bench's root before the runs"))


# Ahead-compile workers started at offload (2 of them; `--ahead-workers 2 --bytecode-cache`): (file, rows).
START_TIME_WORKERS = (("start_time_early_workers_flux.json", ("flux:int8:blocks",)),
                      ("start_time_early_workers_flux_bf16.json", ("flux:bf16:blocks",)),
                      ("start_time_early_workers_qwen.json", ("qwen:int8:blocks",)),
                      ("start_time_early_workers_qwen32.json", ("qwen32:int8:blocks",)))
_RUN_LABELS = {"coldprofile": "cold, no workers", "serial": "cold, no workers", "cold": "cold, 2 workers"}


def start_time_workers_table() -> str:
    """Seconds to the first step with two ahead-compile workers started at offload, against the serial cold run."""
    return start_time_blocks_table(START_TIME_WORKERS, (
        "Each run a fresh process (`benches/start_time.py --rows <row> --modes coldprofile cold warm "
        "--ahead-workers 2 --bytecode-cache --profile-steps 1`; Flux bf16, Qwen-7B and Qwen-32B without the "
        "no-workers run), LoRA r=16, AdamW, `stagehand.compile_blocks`, weights built in memory; `vram_budget` "
        "Flux 16 GiB, Qwen-7B 20 GiB, Qwen-32B 40 GiB. cold: every cache empty, two ahead-compile workers "
        "(`STAGEHAND_AHEAD_WORKERS=2`, started by `offload()`); cold, no workers: the same without them (its "
        "second step ran under cProfile, so its step 2 is the profiler's); warm: a second process on the same "
        "machine. Step 2 of a cold run is the first under the plan made from the calibration step"),
        run=lambda r: _RUN_LABELS.get(r["mode"], r["mode"]))


# The heap frozen at offload, allocated bytes read from the nested statistics (this session's code): (file, rows).
START_TIME_FREEZE = (("start_time_freeze_flux_files.json", ("flux:int8:files:blocks",)),
                     ("start_time_freeze_flux_qwen32.json", ("flux:int8:blocks", "qwen32:int8:blocks")),
                     ("start_time_freeze_flux_bf16.json", ("flux:bf16:blocks",)),
                     ("start_time_freeze_qwen.json", ("qwen:int8:blocks",)))


def _first_step_gc(r: dict) -> str:
    """The collector's seconds from offload's end to the first step's end (start_time.py's CollectorClock)."""
    before, after = r.get("gc_to_offload_end"), r.get("gc_to_first_step_end")
    return "" if not before or not after else f"{sum(after['s']) - sum(before['s']):.2f}"


def _first_planned(r: dict) -> int:
    """Where a run's made plan starts: `step_ms[i]` is step i + 1 and `plan_kinds[i]` the plan after step i, so
    `step_ms[i]` is the first step under the made plan for the first i whose plan_kinds[i] is "planned"."""
    return r["plan_kinds"].index("planned")


def _new_plan_steps(r: dict) -> str:
    """The steps that measure a new plan over the steady step: a cold run's first two under the plan made from
    the calibration (`plan_kinds[i]` is the plan step i + 2 runs: a calibration measured again runs one more
    calibrating step), a warm run's step 2 (its first is the first step)."""
    first = _first_planned(r) if r["mode"] == "cold" and "planned" in r["plan_kinds"] else 0
    steps = r["step_ms"][first:first + 2] if r["mode"] == "cold" else r["step_ms"][:1]
    return " / ".join(f"{s / r['steady_ms']:.2f}" for s in steps)


def _predicted_over_steady(r: dict) -> str:
    """The last plan's predicted step over the measured steady step (its summary in `plan_changes`)."""
    summary = r["plan_changes"][-1][1] if r.get("plan_changes") else ""
    found = re.search(r"predicted step ([0-9.]+) ms", summary)
    return f"{float(found.group(1)) / r['steady_ms']:.2f}" if found and "default cost model" not in summary else ""


def _waited_for_workers(r: dict) -> str:
    """Seconds the cold step waited for its ahead-compile workers, and of them the seconds it tuned W8A16 keys."""
    ahead = r.get("ahead")
    if not ahead:
        return ""
    return f"{ahead['waited_s']:.1f} ({ahead.get('busy_waiting_s', 0.0):.1f})"


START_TIME_DEFERRED = (("start_time_deferred_files.json", ("flux:int8:files:blocks",)),
                       ("start_time_deferred_flux_qwen32.json", ("flux:int8:blocks",)),
                       ("start_time_final_flux.json", ("flux:int8:blocks",)),
                       ("start_time_deferred_flux_bf16.json", ("flux:bf16:blocks",)),
                       ("start_time_final_qwen32.json", ("qwen32:int8:blocks",)),
                       ("start_time_final_qwen.json", ("qwen:int8:blocks",)))


def start_time_deferred_table() -> str:
    """Seconds to the first step with the W8A16 tuning deferred to the wait on the workers, and the calibration
    that measures a step free of first runs."""
    return start_time_blocks_table(START_TIME_DEFERRED, (
        "Each run a fresh process (`benches/start_time.py --rows <row> --modes cold warm --ahead-workers 2 "
        "--bytecode-cache`, the checkpoint + slab row with `--drop-page-cache`), LoRA r=16, AdamW, "
        "`stagehand.compile_blocks`; `vram_budget` Flux 16 GiB, Qwen-7B 20 GiB, Qwen-32B 40 GiB; cold: every cache "
        "empty, two ahead-compile workers started by `offload()`; warm: a second process on the same machine. "
        "Flux int8 in memory ran twice, in two calls. \"waited s (tuning)\": the cold step's wait for its "
        "workers, and the W8A16 tuning it did meanwhile. \"new-plan steps / steady\": a cold run's first two steps "
        "under the plan made from the calibration, a warm run's step 2, over the steady step; \"predicted / "
        "steady\": that plan's predicted step over the measured one"),
        extra=[Col("waited s (tuning)", _waited_for_workers), Col("new-plan steps / steady", _new_plan_steps),
               Col("predicted / steady", _predicted_over_steady)])


START_TIME_SHORTLIST = (("start_time_preload_flux.json", ("flux:int8:blocks",)),
                        ("start_time_shortlist_flux.json", ("flux:int8:blocks",)),
                        ("start_time_preload_flux_bf16.json", ("flux:bf16:blocks",)),
                        ("start_time_reserve_qwen32.json", ("qwen32:int8:blocks",)),
                        ("start_time_reserve_held_qwen32.json", ("qwen32:int8:blocks",)),
                        ("start_time_preload_qwen.json", ("qwen:int8:blocks",)),
                        ("start_time_reserve_held_qwen.json", ("qwen:int8:blocks",)))


def _tuned(r: dict) -> str:
    """The W8A16 keys the run tuned, their candidates, and the seconds compiling them took."""
    t = r.get("tuning") or {}
    return f"{t['keys']} / {t['candidates']} ({t['precompile_s']:.1f})" if t.get("keys") else ""


def _held_ahead(r: dict) -> str:
    """GiB the allocator was made to hold for a made plan's peak before its first step, and the ms it took."""
    held = r.get("plan_reservations") or []
    return ", ".join(f"{h['gib']:.1f} ({h['s'] * 1e3:.0f})" for h in held)


def start_time_shortlist_table() -> str:
    """Seconds to the first step with the tuner's shortlists, variants loaded while the step waits, and a made
    plan's peak held ahead."""
    return start_time_blocks_table(START_TIME_SHORTLIST, (
        "Each run a fresh process (`benches/start_time.py --rows <row> --modes cold warm --steps 6 --ahead-workers 2 "
        "--bytecode-cache`; Qwen-32B cold only), LoRA r=16, AdamW, `stagehand.compile_blocks`; `vram_budget` Flux "
        "16 GiB, Qwen-7B 20 GiB, Qwen-32B 40 GiB; cold: every cache empty, two ahead-compile workers started by "
        "`offload()`; warm: a second process on the same machine. Four calls, each on its own machine. "
        "`start_time_shortlist_flux.json` is the commit before the step loaded finished variants while it waits; "
        "`start_time_reserve_held_*` the last commit, whose reservation holds pieces until the cache holds the "
        "plan's peak (the others allocated the shortfall once). "
        "\"W8A16 keys / candidates (s)\": the keys the cold step tuned, the candidates it timed, the seconds "
        "compiling them took. \"waited s (working)\": the cold step's wait for its workers, and of it the "
        "seconds it tuned and loaded finished variants. \"held ahead GiB (ms)\": memory the allocator was made to "
        "hold for the made plan's peak when it was applied. \"new-plan steps / steady\": a cold run's first "
        "two steps under the plan made from the calibration, a warm run's step 2, over the steady step"),
        extra=[Col("W8A16 keys / candidates (s)", _tuned), Col("waited s (working)", _waited_for_workers),
               Col("held ahead GiB (ms)", _held_ahead), Col("new-plan steps / steady", _new_plan_steps)])


# Flux int8 in memory: per-kernel compile seconds, then the workers' waits put off, then one config per kernel
# (STAGEHAND_INDUCTOR_AUTOTUNE), the last three runs in one call on one machine.
START_TIME_ONE_CONFIG = (
    ("start_time_kernel_times_flux.json", "every kernel autotuned; waits per graph"),
    ("start_time_deferred_waits_flux.json", "every kernel autotuned; waits put off"),
    ("start_time_deferred_waits_flux_bf16.json", "every kernel autotuned; waits put off"),
    ("start_time_inductor_autotune_flux.json", "every kernel autotuned (=1); waits put off"),
    ("start_time_one_config_reductions_timed_flux.json", "reductions autotuned, pointwise one config"),
    ("start_time_one_config_flux.json", "pointwise autotuned, reductions one config (default)"),
    ("start_time_one_config_none_flux.json", "one config for every kernel (=0)"),
)


def _single_block_training_job(r: dict) -> dict:
    """The cold run's last training job handed to a worker: Flux's single block, the step's critical path."""
    jobs = [j for j in (r.get("ahead") or {}).get("jobs", []) if "grad on" in j["label"]]
    return max(jobs, key=lambda j: j["submitted_s"]) if jobs else {}


def _critical_job(r: dict) -> str:
    """That job's seconds in its worker, and its slowest Triton kernel's compile seconds."""
    job = _single_block_training_job(r)
    slowest = (job.get("kernels") or {}).get("slowest") or [["", 0.0]]
    return f"{job['worker_s']:.1f} ({slowest[0][1]:.1f})" if "worker_s" in job else ""


def start_time_one_config_table() -> str:
    """Seconds to the first step with the workers' kernel waits put off and one launch config per Inductor kernel."""
    sources = tuple((name, ("flux:int8:blocks", "flux:bf16:blocks")) for name, _ in START_TIME_ONE_CONFIG)
    labels = dict(START_TIME_ONE_CONFIG)
    return start_time_blocks_table(sources, (
        "Each run a fresh process (`benches/start_time.py --rows <row> --modes cold warm --steps 5-7 "
        "--ahead-workers 2 --bytecode-cache`, with `STAGEHAND_INDUCTOR_AUTOTUNE` as the run column says), LoRA r=16, "
        "AdamW, `stagehand.compile_blocks`, `vram_budget` 16 GiB; cold: every cache empty, two ahead-compile "
        "workers started by `offload()`; warm: a second process on the same machine. Four calls, each on its own "
        "H100 machine; the three runs of `start_time_inductor_autotune_flux.json`, "
        "`start_time_one_config_reductions_timed_flux.json` and `start_time_one_config_flux.json` in one call. "
        "\"single-block job s (slowest kernel s)\": the cold step's critical path, the single block's training "
        "variant in its worker, and the compile seconds of its slowest Triton kernel (the q/k RMSNorm fused with "
        "the rotary embedding)"),
        run=lambda r: f"{r['mode']}: {labels[r['_source']]}",
        extra=[Col("single-block job s (slowest kernel s)", _critical_job),
               Col("waited s (working)", _waited_for_workers)], modes=("cold", "warm"))


# This session's runs: (file, rows, what the run's code had), one machine per file group (see the caption).
START_TIME_HINTS = (
    ("start_time_hints_flux.json", ("flux:int8:blocks",), "residual-stream hints"),
    ("start_time_hints_flux_autotune0.json", ("flux:int8:blocks",), "hints; every kernel one config (=0)"),
    ("start_time_gc_hold_flux.json", ("flux:int8:blocks",), "hints; full collections held (taken out)"),
    ("start_time_hints_flux_bf16.json", ("flux:bf16:blocks",), "residual-stream hints"),
    ("start_time_gc_hold_flux_bf16.json", ("flux:bf16:blocks",), "hints; full collections held (taken out)"),
    ("start_time_hints_files.json", ("flux:int8:files:blocks",), "residual-stream hints"),
    ("start_time_hints_qwen.json", ("qwen:int8:blocks",), "residual-stream hints"),
    ("start_time_hints_qwen32.json", ("qwen32:int8:blocks",), "residual-stream hints"),
)


def _step_inductor_compiles(r: dict) -> str:
    """The Inductor kernels the main process compiled itself in the first step (Triton's listener; Inductor's
    occupancy re-tune at a variant's load, compiler/ahead_worker.load_only_rescalable_reductions): how many, their
    seconds."""
    per_kernel = (r.get("main_triton_compiles") or {}).get("per_kernel") or {}
    ours = [v for k, v in per_kernel.items() if k.startswith("triton_")]
    return f"{sum(n for n, _ in ours)} ({sum(s for _, s in ours):.1f})" if ours or r["mode"] == "cold" else ""


# The runs of a session's start-time files: one fresh process per run, two workers started at offload.
_WORKER_RUNS = (
    "Each run a fresh process (`benches/start_time.py --rows <row> --modes cold warm --steps {steps} "
    "--ahead-workers 2 --bytecode-cache`, the checkpoint + slab row with `--drop-page-cache`), LoRA r=16, "
    "AdamW, `stagehand.compile_blocks`{autotune}; `vram_budget` Flux 16 GiB, Qwen-7B 20 GiB, Qwen-32B 40 GiB; "
    "cold: every cache empty, two ahead-compile workers started by `offload()`; warm: a second process on the "
    "same machine. ")


def _labelled_start_time_table(sources, caption: str, extra: list) -> str:
    """`start_time_blocks_table` over (file, rows, label) sources, each run named by its mode and its file's label."""
    labels = {name: label for name, _, label in sources}
    return start_time_blocks_table(tuple((name, rows) for name, rows, _ in sources), caption,
                                   run=lambda r: f"{r['mode']}: {labels[r['_source']]}", extra=extra,
                                   modes=("cold", "warm"))


def start_time_hints_table() -> str:
    """Seconds to the first step with the residual-stream hints (one Dynamo graph per block structure in a run
    after the first); two runs also held full collections through the first step, a change taken out after."""
    return _labelled_start_time_table(START_TIME_HINTS, (
        _WORKER_RUNS.format(steps="5-7", autotune=", `STAGEHAND_INDUCTOR_AUTOTUNE` at its default unless the run says")
        + "Four calls, each on its "
        "own H100 machine: the first three Flux files; the Qwen files; the checkpoint + slab file; the two "
        "`gc_hold` files (whose int8 warm run the call's time limit cut; their commit also held Python's full "
        "collections from offload's end to the first step's end, taken out after: a runtime whose steps never end "
        "kept them held). \"Dynamo graphs\": traced by the end "
        "of the first step. \"collector s\": Python's garbage collector from offload's end to the first step's "
        "end. \"Inductor compiles in the step\": kernels the main process compiled itself, and their seconds. "
        "\"new-plan steps / steady\": a cold run's first two steps under the plan made from the calibration, a "
        "warm run's first step, over the steady step"),
        [Col("Dynamo graphs", field("dynamo_graphs", num, 0)), Col("collector s", _first_step_gc),
         Col("Inductor compiles in the step", _step_inductor_compiles),
         Col("new-plan steps / steady", _new_plan_steps)])


# This session's runs: the provisional dequantize, first compiled on a thread of the offloading process, then by
# the first ahead-compile worker with the first plan's margin, then with the tuning candidates compiled ahead in
# the workers (file, rows, what the run's code had).
START_TIME_PROVISIONAL = (
    ("start_time_provisional_flux.json", ("flux:int8:blocks",), "dequantize on an offload thread"),
    ("start_time_margin_flux.json", ("flux:int8:blocks",), "dequantize by the first worker; first plan's margin"),
    ("start_time_provisional_files.json", ("flux:int8:files:blocks",), "dequantize on an offload thread"),
    ("start_time_margin_files.json", ("flux:int8:files:blocks",),
     "dequantize by the first worker; first plan's margin (a slower machine)"),
    ("start_time_provisional_flux_bf16.json", ("flux:bf16:blocks",), "workers' reductions (no int8)"),
    ("start_time_provisional_qwen.json", ("qwen:int8:blocks",), "dequantize on an offload thread"),
    ("start_time_margin_qwen.json", ("qwen:int8:blocks",),
     "dequantize by the first worker; first plan's margin (a slower machine)"),
    ("start_time_margin_qwen32.json", ("qwen32:int8:blocks",), "dequantize by the first worker; first plan's margin"),
    ("start_time_ahead_tuning_flux.json", ("flux:int8:blocks",), "tuning candidates compiled ahead, in the workers"),
    ("start_time_ahead_tuning_files.json", ("flux:int8:files:blocks",),
     "tuning candidates compiled ahead, in the workers"),
    ("start_time_ahead_tuning_qwen.json", ("qwen:int8:blocks",), "tuning candidates compiled ahead, in the workers"),
    ("start_time_ahead_tuning_qwen32.json", ("qwen32:int8:blocks",),
     "tuning candidates compiled ahead, in the workers (a slower machine)"),
)


def _second_structure_handed_over(r: dict) -> str:
    """Seconds into a cold first step at which the second block structure's training variant went to a worker
    (the step's clock start and the jobs' on the ahead pool's clock): what the eager forward spent before it."""
    start = (r.get("main_triton_compiles") or {}).get("step_start_s")
    jobs = [j for j in (r.get("ahead") or {}).get("jobs", []) if not j.get("later")]
    return f"{jobs[1]['submitted_s'] - start:.1f}" if start and len(jobs) > 1 else ""


def _step_triton_compiles(r: dict) -> str:
    """Every Triton compile of the main process in the first step (W8A16 candidates and defaults, Inductor's
    re-tuned reductions): how many, their seconds added up (the tuner's run side by side)."""
    compiles = r.get("main_triton_compiles") or {}
    return f"{compiles['count']} ({compiles['seconds']:.1f})" if compiles.get("count") or r["mode"] == "cold" else ""


def _peak_replans(r: dict) -> str:
    """Plans re-made because a new plan's first step measured a peak over the soft cap."""
    return str(sum("re-planned" in note for note in r.get("plan_corrections") or []))


def start_time_provisional_table() -> str:
    """Seconds to the first step with the deferred keys' dequantize (tune.provisional_config), the workers' re-tuned
    reductions, the first calibrated plan's margin and the tuning candidates compiled ahead."""
    return _labelled_start_time_table(START_TIME_PROVISIONAL, (
        _WORKER_RUNS.format(steps="5-6", autotune="")
        + "On H100 machines: the `provisional` files on one (two calls); the `margin` Flux "
        "int8 and Qwen-32B files on a second; the `margin` Qwen-7B and checkpoint + slab files on a third (two "
        "calls), slower than the others in every row it ran (steady steps: Qwen-7B 185-196 ms, Flux 663-670 ms); "
        "the `ahead_tuning` files on a fourth (two calls), but its Qwen-32B file on a fifth, slower (steady step "
        "860-876 ms against 787-811 ms). Eight calls on five machines in all. "
        "\"second structure handed over s\": seconds into the cold step at which the single block's (Qwen: none) "
        "training variant went to a worker. \"main-process Triton "
        "compiles\": every kernel the step compiled itself (W8A16 defaults and candidates, Inductor's re-tuned "
        "reductions), their seconds added up. \"peak re-plans\": plans re-made because a new plan's first step "
        "measured a peak over the cap. \"new-plan steps / steady\": a cold run's first two steps under the plan "
        "made from the calibration, a warm run's first step, over the steady step"),
        [Col("second structure handed over s", _second_structure_handed_over),
         Col("main-process Triton compiles", _step_triton_compiles),
         Col("Inductor compiles in the step", _step_inductor_compiles),
         Col("peak re-plans", _peak_replans), Col("new-plan steps / steady", _new_plan_steps)])


# Offload from the checkpoint + slab with the page cache dropped, by offload's stage clock (file, what the code had,
# the read bench of the same call or None). One H100 machine per call; the first file's call ran three cold runs.
START_TIME_SLAB = (
    ("start_time_stages_files_default.json", "before: pins after the reads, identity check before them", None),
    ("start_time_stages_files_notuning.json", "before; no tuning candidates in the workers", None),
    ("start_time_stages_files_noworkers.json", "before; no ahead-compile workers", None),
    ("start_time_slab_pins_files.json", "each INT8 block locked as its rows land; identity check, then imports, "
     "beside the reads (kept)", "slab_reads.json"),
    ("start_time_identity_thread_files.json", "identity check on its own thread beside the imports; GIL switch "
     "0.5 ms (taken out)", "slab_reads_switch.json"),
    ("start_time_read_ahead_files.json", "the same, and the compiler's files read ahead (taken out)",
     "slab_reads_read_ahead.json"),
    ("start_time_identity_beside_A_files.json", "identity check, then imports, beside the reads (the kept code "
     "above, rerun)", None),
    ("start_time_identity_beside_B_files.json", "identity check on a worker beside the imports, same machine as "
     "the row above (kept)", None),
    ("start_time_identity_beside_files.json", "identity check on a worker beside the imports, another machine",
     None),
)
_PINS = "precision copies built, host store pinned"
_SLAB_STAGES = ("slab rows read", _PINS, "resident tensors to the device", "device slots")


def _stage(name: str) -> Callable[[dict], str]:
    return lambda r: num((r.get("offload_stages_s") or {}).get(name))


def _beside(name: str) -> Callable[[dict], str]:
    return lambda r: num((r.get("offload_beside_s") or {}).get(name))


def _identity_s(r: dict) -> str:
    """The identity check's seconds: beside the reads, or (before) a stage of its own ahead of them."""
    stages, beside = r.get("offload_stages_s") or {}, r.get("offload_beside_s") or {}
    if "slab identity check" in beside:
        return num(beside["slab identity check"])
    before = stages.get("slab opened, identity checked")
    return f"{before:.2f} (before the reads)" if before is not None else ""


def _other_stages(r: dict) -> str:
    stages = r.get("offload_stages_s") or {}
    return num(stages["total"] - sum(stages.get(k, 0.0) for k in _SLAB_STAGES)
               - stages.get("slab opened, identity checked", 0.0)) if "total" in stages else ""


def start_time_slab_table() -> str:
    """Where offload from the checkpoint + slab spends its seconds with the page cache dropped (offload's stage
    clock), and the disk's own read seconds in the same call."""
    rows = []
    for name, label, reads in START_TIME_SLAB:
        disk = next((x["seconds"] for x in load(reads)["rows"] if x["mode"] == "disk"), None) if reads else None
        for r in load(name)["runs"]:
            rows.append(dict(r, _label=label, _disk=disk, _source=name))
    cols = [Col("code", lambda r: r["_label"]), Col("run", lambda r: r["mode"]),
            Col("offload s", field("offload_s")), Col("first step s", field("first_step_s")),
            Col("slab rows read s", _stage("slab rows read")), Col("reads ended s", _beside("slab reads")),
            Col("identity check s", _identity_s),
            Col("compiler imports s", _beside("compiler imports and source index")),
            Col("page-lock s", _stage(_PINS)), Col("resident tensors s", _stage("resident tensors to the device")),
            Col("device slots s", _stage("device slots")), Col("other stages s", _other_stages),
            Col("disk alone s (same call)", lambda r: num(r["_disk"]) if r["mode"] == "cold" else ""),
            Col("source", lambda r: f"`{r['_source']}`")]
    what = ("Flux-dev 12B int8 offloaded from its safetensors checkpoint and INT8 slab (11.9 GB) on the disk "
            "(`benches/start_time.py --rows flux:int8:files:blocks --modes cold [warm] --steps 4-6 --ahead-workers 2 "
            "--bytecode-cache --drop-page-cache`; the no-workers run `--ahead-workers 0`, the no-candidates run "
            "`STAGEHAND_AHEAD_TUNING=0`); cold: the page cache dropped, warm: a second process with the files in "
            "it. Six calls, each on its own H100 machine; the `identity_beside_A` and `_B` files in one call (B "
            "first; B's warm run was cut off by the call's time limit), whose disk read the slab alone in 8.07 s "
            "(`dd`, `start_time_identity_beside_disk.log`). \"slab rows read s\": offload's stage from the first "
            "read to the last of the work beside the reads; \"reads ended s\": when the last read ended, from "
            "the first; \"identity check s\" and \"compiler imports s\": the calling thread's work beside the "
            "reads; \"page-lock s\": the stage that locked the INT8 copies after the reads (the reader threads "
            "lock them since); \"disk alone s\": `benches/slab_reads.py`'s 8-thread read of the slab file in the "
            "same call, page cache dropped")
    return f"{caption(*[n for n, _, _ in START_TIME_SLAB], what=what)}\n\n{table(rows, cols)}\n"


# Offload from the checkpoint + slab with the preparation's files read ahead, each call's new code against the code
# before (692c4e1) on the same machine: (file, what the code had, the call's dd log).
START_TIME_READ_AHEAD = (
    ("start_time_module_files_files.json", "the compiler's module bytecode read ahead; the resident tensors' pages "
     "read beside the reads", "start_time_module_files_disk.log"),
    ("start_time_module_files_A_files.json", "before (692c4e1), same machine as the row above",
     "start_time_module_files_disk.log"),
    ("start_time_torch_key_files.json", "and torch's sources read ahead, which Inductor hashes for its compile "
     "workers (kept)", "start_time_torch_key_disk.log"),
    ("start_time_torch_key_A_files.json", "before (692c4e1), same machine as the row above",
     "start_time_torch_key_disk.log"),
)
_PREPARATION = "compiler imports and source index"


def _dd_seconds(log: str | None) -> float | None:
    """The seconds `dd` reported in a disk log (its last "copied, S s" line); None without one."""
    if log is None:
        return None
    found = re.findall(r"copied, ([0-9.]+) s", (RESULTS / log).read_text())
    return float(found[-1]) if found else None


def _beside_the_disk(sources) -> list[dict]:
    """Each run of (file, what the code had, the call's dd log), with the disk's seconds in the same call."""
    return [dict(r, _label=label, _disk=_dd_seconds(disk), _source=name)
            for name, label, disk in sources for r in load(name)["runs"]]


def _over_disk(r: dict) -> str:
    """A cold offload's seconds over the disk's own read of the slab in the same call."""
    return num(r["offload_s"] - r["_disk"]) if r["mode"] == "cold" and r["_disk"] else ""


def _disk_alone(r: dict) -> str:
    return num(r["_disk"]) if r["mode"] == "cold" else ""


def _against_the_disk(*extra: Col) -> list[Col]:
    """The last columns of a table of offloads from files: the disk alone, what offload took over it, the file."""
    return [Col("disk alone s (dd, same call)", _disk_alone), *extra, Col("offload - disk s", _over_disk),
            Col("source", lambda r: f"`{r['_source']}`")]


def _files_offload(steps: str, calls: str) -> str:
    """The first words of such a table's caption: the row, its command, and how many calls ran it."""
    return ("Flux-dev 12B int8 offloaded from its safetensors checkpoint and INT8 slab (11.9 GB) on the disk "
            f"(`benches/start_time.py --rows flux:int8:files:blocks --modes cold [warm] --steps {steps} "
            f"--ahead-workers 2 --bytecode-cache --drop-page-cache`); {calls} calls, each on its own H100 machine")


def start_time_read_ahead_table() -> str:
    """Offload from the checkpoint + slab, page cache dropped, by its stage clock: the preparation's parts beside
    the reads, the read-ahead before them, against the disk's own read of the slab in the same call."""
    rows = _beside_the_disk(START_TIME_READ_AHEAD)
    cols = [Col("code", lambda r: r["_label"]), Col("run", lambda r: r["mode"]),
            Col("offload s", field("offload_s")), Col("slab rows read s", _stage("slab rows read")),
            Col("reads ended s", _beside("slab reads")),
            Col("files read ahead s (before the reads)", _beside("compiler's files read ahead")),
            Col("compiler's preparation s", _beside(_PREPARATION)),
            Col("of it: compile workers started s", _beside("compile workers started")),
            Col("identity check s", _beside("slab identity check")),
            Col("resident pages read s", _beside("resident tensors' pages read")),
            Col("resident tensors s", _stage("resident tensors to the device")), *_against_the_disk()]
    what = (_files_offload("6", "two") + ", each running its code (cold, warm) and then the code before (692c4e1, cold) on the same machine and files, then `dd` of the "
            "slab after the page cache was dropped. The first call's files were written as "
            "`start_time_read_ahead2_*`. \"files read ahead s\": the read-ahead's own seconds on its thread, "
            "beside offload's stages before the reads (the reads waited 0.00 s for it in every run); \"compiler's "
            "preparation s\": the calling thread's work beside the reads (compile workers started, compiler "
            "imported, sources indexed); \"resident pages read s\": the resident tensors' pages read from the "
            "checkpoint after it, beside the reads; \"resident tensors s\": the stage that loads them after the "
            "reads")
    return f"{caption(*[n for n, _, _ in START_TIME_READ_AHEAD], what=what)}\n\n{table(rows, cols)}\n"


# Offload from the checkpoint + slab, this session's three calls: each call's new code, then the code before it on
# the same machine and files (cold), then dd: (file, what the code had, the call's dd log).
START_TIME_SLAB_OPEN = (
    ("start_time_zero_points_files.json", "zero points checked by each layer's read, not in a pass at open; each "
     "block's reads start once it is laid out (9cc68e8)", "start_time_zero_points_disk.log"),
    ("start_time_zero_points_A_files.json", "before (498a69e), same machine as the row above",
     "start_time_zero_points_disk.log"),
    ("start_time_rows_ahead_files.json", "and the identity's sampled rows read ahead, a pread per row (ae0f63d, "
     "kept)", "start_time_rows_ahead_disk.log"),
    ("start_time_rows_ahead_A_files.json", "before (9cc68e8), same machine as the row above",
     "start_time_rows_ahead_disk.log"),
    ("start_time_kernel_ahead_files.json", "and the slab's pages asked of the kernel ahead, blocks read in the "
     "file's order (8e71ac6, taken out)", "start_time_kernel_ahead_disk.log"),
    ("start_time_kernel_ahead_A_files.json", "before (ae0f63d, kept), same machine as the row above",
     "start_time_kernel_ahead_disk.log"),
)


def start_time_slab_open_table() -> str:
    """Offload from the checkpoint + slab by its stage clock, each call's code against the code before it on the
    same machine, and the disk's own read of the slab there."""
    rows = _beside_the_disk(START_TIME_SLAB_OPEN)

    def reads_over_disk(r: dict) -> str:
        reads = (r.get("offload_beside_s") or {}).get("slab reads")
        return num(reads / r["_disk"]) if r["mode"] == "cold" and r["_disk"] and reads else ""

    cols = [Col("code", lambda r: r["_label"]), Col("run", lambda r: r["mode"]),
            Col("offload s", field("offload_s")), Col("slab opened s", _stage("slab opened")),
            Col("wait for the files read ahead s", _stage("compiler's files read ahead (the wait)")),
            Col("slab rows read s", _stage("slab rows read")), Col("reads ended s", _beside("slab reads")),
            Col("identity check s", _beside("slab identity check")),
            Col("resident pages read s", _beside("resident tensors' pages read")),
            Col("compiler's preparation s", _beside(_PREPARATION)),
            Col("device slots s", _stage("device slots")), *_against_the_disk(Col("reads / disk", reads_over_disk))]
    what = (_files_offload("10", "three") + ", each running its code (cold, and warm where it says) and then the code before it (cold) on the same machine and files, then "
            "`dd` of the slab after the page cache was dropped. \"slab opened s\": the stage that opens and checks "
            "the slab (before 9cc68e8 it also read every zero point and laid out every block; the layout now goes "
            "beside the reads, in their seconds); \"reads ended s\": from the first read to the last; \"identity check s\", "
            "\"resident pages read s\" and \"compiler's preparation s\": work beside the reads, on threads of its "
            "own and the calling thread; \"device slots s\": the stage after the reads (a first offload on a "
            "machine measures the host link there)")
    return f"{caption(*[n for n, _, _ in START_TIME_SLAB_OPEN], what=what)}\n\n{table(rows, cols)}\n"


# Offload from the checkpoint + slab with the slab's rows read by a reader process or by threads
# (`start_time.py --slab-reads`), in the order each call ran them: (file, who read, the call's dd log or None).
START_TIME_READS = (
    ("start_time_reads_process_I.json", "process (7753a06), 1st", "start_time_reads_disk_I.log"),
    ("start_time_reads_threads_I.json", "threads (7753a06), 2nd", "start_time_reads_disk_I.log"),
    ("start_time_reads_process2_I.json", "process (7753a06), 3rd", "start_time_reads_disk_I.log"),
    ("start_time_reads_process_J.json", "process (c36ae4e), 1st", "start_time_reads_disk_J.log"),
    ("start_time_reads_threads_J.json", "threads (c36ae4e), 2nd", "start_time_reads_disk_J.log"),
    ("start_time_reads_process2_J.json", "process (c36ae4e), 3rd", "start_time_reads_disk_J.log"),
    ("start_time_reads_process_K.json", "process (efa7eba), the call's one run", None),
)


def start_time_reads_table() -> str:
    """Offload from the checkpoint + slab, the slab's rows read by a reader process or by reader threads, in the
    same call on the same machine and files, against the disk's own read of the slab there."""
    rows = _beside_the_disk(START_TIME_READS)

    def reads_over_disk(r: dict) -> str:
        reads = (r.get("offload_beside_s") or {}).get("slab reads")
        return num(reads / r["_disk"]) if r["_disk"] and reads else ""

    cols = [Col("read by, run", lambda r: r["_label"]), Col("offload s", field("offload_s")),
            Col("slab rows read s", _stage("slab rows read")), Col("reads ended s", _beside("slab reads")),
            Col("identity check s", _beside("slab identity check")),
            Col("resident pages read s", _beside("resident tensors' pages read")),
            Col("compiler's preparation s", _beside(_PREPARATION)), Col("first step s", field("first_step_s")),
            *_against_the_disk(Col("reads / disk", reads_over_disk))]
    what = (_files_offload("10", "three") + ", cold, with `--slab-reads process` (\"auto\", the default: "
            "`Config(slab_reads=\"auto\")`) or `--slab-reads threads`, in the order listed within a call; calls I "
            "and J then ran `dd` of the slab after the page cache was dropped; call K ran the read bench instead "
            "(the `slab_reads_process` table: its disk read the slab in 7.67 s on 8 threads). \"reads ended s\": from "
            "the first read to the last; \"identity check s\", \"resident pages read s\" and \"compiler's "
            "preparation s\": work beside the reads")
    return f"{caption(*[n for n, _, _ in START_TIME_READS], what=what)}\n\n{table(rows, cols)}\n"


# Offload from the checkpoint + slab with the slab's rows read behind offload (`--rows-behind on`, the default) or
# before it returns (`off`), in the order each call ran them: (file, what, the call's dd log).
START_TIME_BEHIND = (
    ("start_time_behind_on_L.json", "behind (50e0fac), 1st", "start_time_behind_disk_L.log"),
    ("start_time_behind_off_L.json", "before offload returns (50e0fac), 2nd", "start_time_behind_disk_L.log"),
    ("start_time_behind_on2_L.json", "behind (50e0fac), 3rd", "start_time_behind_disk_L.log"),
    ("start_time_behind_on_M.json", "behind, zero points on threads beside the identity (39a967a), 1st",
     "start_time_behind_disk_M.log"),
    ("start_time_behind_on2_M.json", "the same (39a967a), 2nd", "start_time_behind_disk_M.log"),
)


def _rows_ended(r: dict) -> str:
    """From the reads' start to the last block read: behind offload (its summary after the first step) or in it."""
    behind = r.get("slab_rows_behind")
    return num(behind["reads_s"]) if behind else _beside("slab reads")(r)


def start_time_behind_table() -> str:
    """Offload from the checkpoint + slab, the rows read behind offload or before it returns, in the same calls on
    the same machines and files: what offload waited for, when the rows were in, and the first step's wait."""
    rows = _beside_the_disk(START_TIME_BEHIND)
    cols = [Col("rows read, run", lambda r: f"{r['_label']}, {r['mode']}"), Col("offload s", field("offload_s")),
            Col("first step s", field("first_step_s")),
            Col("offload + first step s", lambda r: num(r["offload_s"] + r["first_step_s"])),
            Col("rows in s (from the reads' start)", _rows_ended),
            Col("first step waited for rows s", lambda r: num((r.get("slab_rows_behind") or {}).get("waited_s"))),
            Col("identity check s", _beside("slab identity check")),
            Col("zero points s", _beside("slab zero points checked")),
            Col("compiler's preparation s", _beside(_PREPARATION)),
            Col("resident pages read s", _beside("resident tensors' pages read")),
            Col("disk alone s (dd, same call)", _disk_alone), Col("source", lambda r: f"`{r['_source']}`")]
    what = ("Flux-dev 12B int8 offloaded from its safetensors checkpoint and INT8 slab (11.9 GB) on the disk "
            "(`benches/start_time.py --rows flux:int8:files:blocks --modes cold [warm] --steps 10 [--replans 8] "
            "--ahead-workers 2 --bytecode-cache --drop-page-cache --rows-behind on|off`), two calls, each on its "
            "own H200 machine, the runs in the order listed; each call then ran `dd` of the slab after the page "
            "cache was dropped (L: 6.94 s, M: 9.47 s, the same disk type reading 1.7 and 1.3 GB/s). \"rows in s\": "
            "from the reader process's start to its last block; \"identity check s\", \"zero points s\" (checked "
            "beside the identity when the rows are read behind), \"compiler's preparation s\" and \"resident pages "
            "read s\": work offload waits for, beside the reads")
    return f"{caption(*[n for n, _, _ in START_TIME_BEHIND], what=what)}\n\n{table(rows, cols)}\n"


# Runs with re-plan rounds (`start_time.py --replans`): (file, model, weights, whether the re-plan was synchronised).
START_TIME_REPLANS = (
    ("start_time_behind_on_M.json", "Flux-dev 12B", "int8, from its checkpoint + slab", "no"),
    ("start_time_behind_on2_M.json", "Flux-dev 12B", "int8, from its checkpoint + slab", "no"),
    ("start_time_replans_flux_bf16_N.json", "Flux-dev 12B", "bf16, built in memory", "no"),
    ("start_time_replans_flux_bf16_O.json", "Flux-dev 12B", "bf16, built in memory", "yes"),
    ("start_time_replans_qwen32_int8_N.json", "Qwen2.5-32B shape", "int8, built in memory", "no"),
    ("start_time_replans_qwen32_int8_O.json", "Qwen2.5-32B shape", "int8, built in memory", "yes"),
    ("start_time_replans_qwen_int8_N.json", "Qwen2.5-7B shape", "int8, built in memory", "no"),
)


def start_time_replans_table() -> str:
    """The steps that measure a new plan against steady steps of the same plan, many re-plans in one process."""
    rows = [dict(r, _model=model, _weights=weights, _synced=synced, _source=name)
            for name, model, weights, synced in START_TIME_REPLANS for r in load(name)["runs"] if r.get("replan_rounds")]

    def rounds(r: dict) -> list[dict]:
        return r["replan_rounds"]["rounds"]

    def first_round(r: dict) -> str:
        first = rounds(r)[0]
        return f"{first['ratio']:.3f} ({', '.join(f'{x:.0f}' for x in first['measuring_ms'])} ms)"

    def changed(r: dict) -> str:  # the plans the rounds applied, against the plan the steps before ran
        before = _plan_counts(r["plan_changes"][-1][1])
        return ", ".join("same" if _plan_counts(x["plan"]) == before else _plan_counts(x["plan"]) for x in rounds(r)[:2])

    cols = [Col("model", lambda r: r["_model"]), Col("weights", lambda r: r["_weights"]),
            Col("run", lambda r: r["mode"]), Col("rounds", lambda r: str(len(rounds(r)))),
            Col("new-plan steps / steady: median of rounds", lambda r: f"{r['replan_rounds']['median_ratio']:.3f}"),
            Col("max", lambda r: f"{r['replan_rounds']['max_ratio']:.3f}"),
            Col("pooled", lambda r: f"{r['replan_rounds']['pooled_ratio']:.3f}"),
            Col("steady steps' spread", lambda r: " - ".join(f"{x:.3f}" for x in r["replan_rounds"]["steady_spread"])),
            Col("round 1 (its two steps)", first_round), Col("plans of rounds 1, 2", changed),
            Col("re-plan synchronised", lambda r: r["_synced"]),
            Col("re-plan s (round 1 / median)", lambda r: f"{rounds(r)[0]['replan_s']:.2f} / "
                f"{statistics.median(x['replan_s'] for x in rounds(r)):.2f}"),
            Col("rounds' steady ms", lambda r: ms(statistics.median(x for y in rounds(r) for x in y["steady_ms"]))),
            Col("source", lambda r: f"`{r['_source']}`")]
    what = ("After a run's steps (`benches/start_time.py ... --steps 10 --replans R`, LoRA r=16, AdamW, `vram_budget` "
            "Flux 16 GiB, Qwen-7B 20 GiB, Qwen-32B 40 GiB), R rounds in the same process of `rt.replan()` between "
            "steps, the two steps that measure the new plan (block clocks on events read a step later, the peak "
            "check), then three steady steps of the same plan that measure nothing; every step synchronised and "
            "timed. A round's ratio: its two new-plan steps' mean over its steady steps' median; \"pooled\": all "
            "new-plan steps' mean over all steady steps' mean; \"steady steps' spread\": the steady steps' "
            "min and max over their median. \"plans of rounds 1, 2\": \"same\" where the round's plan holds "
            "the counts of the plan the steps before it ran. \"re-plan synchronised\": the bench waits for the "
            "re-plan's device work before the next step's clock (as a calibration step's own synchronisation "
            "does: a changed plan's new resident blocks go up the link there); where not (calls M, N), a changed "
            "plan's uploads land in round 1's first step. Three calls, each on its own H200 machine (M, N, O; the "
            "Flux int8 rows from files are the `start_time_behind` table's runs). Qwen-7B's plan at 20 GiB holds every "
            "block resident on this machine: its new-plan steps measure a plan that streams nothing")
    return f"{caption(*[n for n, _, _, _ in START_TIME_REPLANS], what=what)}\n\n{table(rows, cols)}\n"


def _plan_counts(summary: str) -> str:
    found = re.search(r"(\d+) resident, (\d+) streamed, (\d+) recomputed", summary)
    return f"{found.group(1)} / {found.group(2)} / {found.group(3)}" if found else summary[:40]


def slab_reads_process_table() -> str:
    """The slab's reads beside the compiler's imports, by threads and by the reader process (benches/slab_reads.py)."""
    what = ("`benches/slab_reads.py --slab <flux.manifest.json> --modes disk store+imports process+imports` (the CPU "
            "run also `store` and `process` alone), each mode a fresh process after the page cache was dropped: "
            "Flux-dev 12B's INT8 slab (11.9 GB) on an H100 machine (call K, after its offload run), and a 1.3 GB "
            "Flux-shaped slab on the 2-core CPU machine. \"x disk\": seconds over the disk's own read of the file "
            "(8 threads, 32 MiB chunks) in the same run")
    return _slab_reads_runs(("slab_reads_process_h100.json", "slab_reads_process_cpu.json"), what)


def _slab_reads_runs(names: tuple[str, ...], what: str) -> str:
    """A table of `benches/slab_reads.py` runs, every mode of each file, under its caption."""
    rows = [dict(r, _source=n) for n in names for r in load(n)["rows"]]
    cols = [Col("mode", lambda r: r["mode"]), Col("what", lambda r: r.get("what", "")),
            Col("reads s", field("seconds")), Col("GB/s", field("gb_s")), Col("x disk", field("x_disk")),
            Col("with what ran beside s", field("call_s")), Col("source", lambda r: f"`{r['_source']}`")]
    return f"{caption(*names, what=what)}\n\n{table(rows, cols)}\n"


# Cold runs whose steps record their one-time work (start_time.py's `step_work`): (file, model).
START_TIME_NEW_PLAN = (
    ("start_time_zero_points_files.json", "Flux-dev 12B int8, checkpoint + slab"),
    ("start_time_zero_points_A_files.json", "Flux-dev 12B int8, checkpoint + slab"),
    ("start_time_rows_ahead_files.json", "Flux-dev 12B int8, checkpoint + slab"),
    ("start_time_rows_ahead_A_files.json", "Flux-dev 12B int8, checkpoint + slab"),
    ("start_time_kernel_ahead_files.json", "Flux-dev 12B int8, checkpoint + slab"),
    ("start_time_kernel_ahead_A_files.json", "Flux-dev 12B int8, checkpoint + slab"),
    ("start_time_step_work_qwen.json", "Qwen2.5-7B shape int8"),
    ("start_time_step_work_qwen_2.json", "Qwen2.5-7B shape int8"),
)


def _new_plan_window(r: dict) -> tuple[list[float], list[dict], list[dict]]:
    """A cold run's planned steps after its two new-plan steps (`_new_plan_steps`), the one-time work of those
    two, and of the steps after them (`step_work[i]` is step i, `step_ms[i]` step i + 1)."""
    first = _first_planned(r)
    return r["step_ms"][first + 2:], r["step_work"][first + 1:first + 3], r["step_work"][first + 3:]


def start_time_new_plan_table() -> str:
    """The steps that measure a new plan against the steady steps, and the one-time work counted in each."""
    rows = [dict(r, _model=model, _source=name) for name, model in START_TIME_NEW_PLAN for r in load(name)["runs"]
            if r["mode"] == "cold" and r.get("step_work")]

    def plan(r: dict) -> str:
        found = re.search(r"(\d+) resident, (\d+) streamed", r["plan_changes"][-1][1])
        return f"{found.group(1)} resident, {found.group(2)} streamed" if found else ""

    def later_range(r: dict) -> str:
        later, _, _ = _new_plan_window(r)
        return f"{min(later) / r['steady_ms']:.2f}-{max(later) / r['steady_ms']:.2f}" if later else ""

    def one_time(r: dict) -> str:
        _, work, later = _new_plan_window(r)
        steady_h2d = statistics.median(w.get("h2d_gib", 0.0) for w in later) if later else 0.0
        return "; ".join(f"units {w.get('compiled', 0)} / {w.get('loaded', 0)} / {w.get('first_run', 0)}, collector "
                         f"{w['gc_s']:.3f} s, {w.get('device_allocs', 0)} new segments "
                         f"({w.get('reserved_gib', 0.0):+.2f} GiB), H2D {w.get('h2d_gib', 0.0) - steady_h2d:+.2f} GiB"
                         for w in work)

    cols = [Col("model", lambda r: r["_model"]), Col("made plan", plan),
            Col("new-plan steps / steady", _new_plan_steps), Col("later planned steps / steady", later_range),
            Col("steady ms", lambda r: ms(r["steady_ms"])),
            Col("one-time work in the two new-plan steps (H2D over a steady step's)", one_time),
            Col("source", lambda r: f"`{r['_source']}`")]
    what = ("Cold runs of this session's calls (`benches/start_time.py --rows <row> --modes cold --steps 10 "
            "--ahead-workers 2 --bytecode-cache`, the checkpoint + slab row with `--drop-page-cache`), each a fresh "
            "process on an H100 machine, LoRA r=16, AdamW, `vram_budget` Flux 16 GiB, Qwen-7B 20 GiB. Each step "
            "synchronised and timed; after it, the one-time work it did, read from host counters: units compiled "
            "/ loaded from the caches (of those compiled) / run for the first time, the collector's seconds, the "
            "allocator's new device segments and reserved GiB, the slot pool's host-to-device GiB. \"new-plan steps\": the first two steps under the plan made "
            "from the calibration (they measure it: block clocks on events, read a step later); \"later planned "
            "steps\": the planned steps after them, the steady step being the median of the last three")
    return f"{caption(*[n for n, _ in START_TIME_NEW_PLAN], what=what)}\n\n{table(rows, cols)}\n"


def preparation_probe_table() -> str:
    """The compiler's preparation timed part by part, alone and beside a slab-sized read (the probe)."""
    data = load("preparation_probe.json")
    labels = {"alone": "alone (no reads)", "reads": "beside 8 threads reading 12 GB",
              "reads+ahead": "the same, the compiler's module bytecode read ahead first (not torch's sources)"}
    cols = [Col("mode", lambda r: labels[r["mode"]]),
            Col("compile workers started s", lambda r: num(r["parts_s"]["compile workers started"])),
            Col("compiler imported, sources indexed s",
                lambda r: num(r["parts_s"]["compiler imported, sources indexed"])),
            Col("total s", lambda r: num(r["parts_s"]["total"])),
            Col("reads s", lambda r: num(r["reads_s"])),
            Col("read ahead: files / MB / s", lambda r: "{files} / {mb:.1f} / {s:.2f}".format(
                mb=r["read_ahead"]["bytes"] / 1e6, **r["read_ahead"]) if r.get("read_ahead") else "")]
    what = ("The compiler's preparation on an H100 machine, part by part (`benches/preparation_probe.py`: "
            + data["how"] + ")")
    return f"{caption('preparation_probe.json', what=what)}\n\n{table(data['runs'], cols)}\n"


# The issue's table: each model's latest runs, (file, model, weights).
START_TIME_LATEST = (
    ("start_time_behind_on_L.json", "Flux-dev 12B", "int8, from its checkpoint + slab on the disk"),
    ("start_time_behind_on2_L.json", "Flux-dev 12B", "int8, from its checkpoint + slab on the disk"),
    ("start_time_behind_on_M.json", "Flux-dev 12B", "int8, from its checkpoint + slab on the disk"),
    ("start_time_behind_on2_M.json", "Flux-dev 12B", "int8, from its checkpoint + slab on the disk"),
    ("start_time_rblock_off_flux_int8.json", "Flux-dev 12B", "int8, built in memory"),
    ("start_time_ahead_tuning_flux.json", "Flux-dev 12B", "int8, built in memory"),
    ("start_time_replans_flux_bf16_N.json", "Flux-dev 12B", "bf16, built in memory"),
    ("start_time_replans_flux_bf16_O.json", "Flux-dev 12B", "bf16, built in memory"),
    ("start_time_rblock_flux_bf16.json", "Flux-dev 12B", "bf16, built in memory"),
    ("start_time_replans_qwen_int8_N.json", "Qwen2.5-7B shape", "int8, built in memory"),
    ("start_time_replans_qwen32_int8_N.json", "Qwen2.5-32B shape", "int8, built in memory"),
    ("start_time_replans_qwen32_int8_O.json", "Qwen2.5-32B shape", "int8, built in memory"),
    ("start_time_torch_key_qwen32.json", "Qwen2.5-32B shape", "int8, built in memory"),
)


def start_time_latest_table() -> str:
    """Offload, first step cold and warm, steady step and the steps that measure a new plan: the latest runs."""
    rows = [dict(r, _model=model, _weights=weights, _source=name)
            for name, model, weights in START_TIME_LATEST for r in load(name)["runs"]]
    cols = [Col("model", lambda r: r["_model"]), Col("weights", lambda r: r["_weights"]),
            Col("run", lambda r: r["mode"]), Col("offload s", field("offload_s")),
            Col("first step s", field("first_step_s")),
            Col("offload + first step s", lambda r: num(r["offload_s"] + r["first_step_s"])),
            Col("steady ms", lambda r: ms(r["steady_ms"])),
            Col("new-plan steps / steady", _new_plan_steps),
            Col("re-plan rounds: median (max)", lambda r: "" if not r.get("replan_rounds") else
                f"{r['replan_rounds']['median_ratio']:.3f} ({r['replan_rounds']['max_ratio']:.3f})"),
            Col("source", lambda r: f"`{r['_source']}`")]
    what = ("Each model's latest runs (`benches/start_time.py --rows <row> --modes cold [warm] [warm] --steps 6-10 "
            "[--replans R] --ahead-workers 2 --bytecode-cache`, the checkpoint + slab row with `--drop-page-cache`), "
            "LoRA r=16, AdamW, `stagehand.compile_blocks`, `vram_budget` Flux 16 GiB, Qwen-7B 20 GiB, Qwen-32B "
            "40 GiB; each run a fresh process, each file's runs on one machine; cold: every cache empty, warm: a "
            "second process. This session's runs are on H200 machines (calls L-O, the current code: the checkpoint "
            "+ slab rows read the slab's rows behind offload; Flux bf16 and Qwen-32B twice, each on its own "
            "machine); the older rows (H100) are each model's earlier latest, Flux int8 in memory from older code "
            "(the changes since touched the slab path, the weights' copies and the reductions' configs). \"new-plan "
            "steps / steady\": a cold run's first two steps under the plan made from the calibration, a warm run's "
            "step 2; \"re-plan rounds\": the `start_time_replans` table's ratio")
    return f"{caption(*[n for n, _, _ in START_TIME_LATEST], what=what)}\n\n{table(rows, cols)}\n"


# A warm Flux bf16 start (its first step in a second process) before and after this session's changes, then the A/B
# of Inductor's RBLOCK growth on one machine: (file, what the code had).
START_TIME_WARM_BF16 = (
    ("start_time_profile_flux_bf16.json", "before: the compiler imported in the first step; a reduction's RBLOCK "
     "grown at its first launch (the profile run under cProfile)"),
    ("start_time_rblock_flux_bf16.json", "the weights copied on a worker beside the compiler's imports; one config "
     "per reduction"),
)
START_TIME_RBLOCK = (
    ("start_time_rblock_off_flux_int8.json", "int8", "off (kept)"),
    ("start_time_rblock_on_flux_int8.json", "int8", "on (Inductor's default)"),
    ("start_time_rblock_on_flux_bf16.json", "bf16", "on (Inductor's default)"),
    ("start_time_rblock_off_flux_bf16.json", "bf16", "off (kept)"),
)


def start_time_warm_bf16_table() -> str:
    """Flux bf16 regional: cold, then warm runs, before and after; where the warm first step's seconds go."""
    rows = [dict(r, _label=label, _source=name) for name, label in START_TIME_WARM_BF16 for r in load(name)["runs"]]
    cols = [Col("code", lambda r: r["_label"]), Col("run", lambda r: r["mode"]),
            Col("offload s", field("offload_s")), Col("first step s", field("first_step_s")),
            Col("Dynamo capture s", field("dynamo_s")), Col("unit loads s", field("first_step_compile_s")),
            Col("rest of the step s", field("first_step_rest_s")), Col("steady ms", field("steady_ms", ms)),
            Col("first loss", lambda r: f"{r['first_loss']:.7f}"),
            Col("compiler imports beside the copies s", _beside("compiler imports and source index")),
            Col("source", lambda r: f"`{r['_source']}`")]
    what = ("Flux-dev 12B bf16 built on the GPU, LoRA r=16, AdamW, `stagehand.compile_blocks`, 16 GiB "
            "(`benches/start_time.py --rows flux:bf16:blocks --modes cold warm warm --steps 5-6 --ahead-workers 2 "
            "--bytecode-cache`); each run a fresh process, each file's runs on one H100 machine. \"unit loads s\": "
            "the block variants loaded from the compile caches in the step; \"rest of the step s\": the first step "
            "less those and Dynamo's capture (the step itself ~0.72 s)")
    return f"{caption(*[n for n, _ in START_TIME_WARM_BF16], what=what)}\n\n{table(rows, cols)}\n"


def _later_steps(r: dict, stat) -> str:
    later = r.get("step_ms", [])[4:]  # the 6th step on
    return ms(stat(later)) if later else ""


def start_time_rblock_table() -> str:
    """The steady step with a reduction's RBLOCK grown at its first launch (Inductor's default) and without."""
    rows = [dict(r, _model=model, _label=label, _source=name) for name, model, label in START_TIME_RBLOCK
            for r in load(name)["runs"]]
    cols = [Col("weights", lambda r: r["_model"]), Col("RBLOCK grown at first launch", lambda r: r["_label"]),
            Col("first step s (cold)", field("first_step_s")),
            Col("steps 6-12 median ms", lambda r: _later_steps(r, statistics.median)),
            Col("steps 6-12 min ms", lambda r: _later_steps(r, min)),
            Col("steps 6-12 max ms", lambda r: _later_steps(r, max)), Col("source", lambda r: f"`{r['_source']}`")]
    what = ("Flux-dev 12B regional, cold runs of 12 steps on one H100 machine, in the order of the rows (every "
            "cache emptied before each); \"off\": `dynamic_scale_rblock=False` under one config per reduction "
            "(compiler/inner.py `one_config_per_kernel`), \"on\": the parent commit's code")
    return f"{caption(*[n for n, _, _ in START_TIME_RBLOCK], what=what)}\n\n{table(rows, cols)}\n"


def slab_reads_table() -> str:
    """The slab's read path against the disk, one change at a time (benches/slab_reads.py), per call."""
    what = ("`benches/slab_reads.py --slab <flux.manifest.json>`: Flux-dev 12B's INT8 slab (11.9 GB), each mode "
            "a fresh process after the page cache was dropped; three calls, each on its own H100 machine (the "
            "modes each call's code had: the second and third ran code taken out since, where offload set the "
            "GIL's switch interval itself and, in the third, read the compiler's files ahead). \"x disk\": "
            "seconds over the disk's own read of the file in the same call")
    return _slab_reads_runs(("slab_reads.json", "slab_reads_switch.json", "slab_reads_read_ahead.json"), what)


def start_time_freeze_table() -> str:
    """Seconds to the first step with the heap frozen at offload (this session's code)."""
    return start_time_blocks_table(START_TIME_FREEZE, (
        "Each run a fresh process (`benches/start_time.py --rows <row> --modes cold warm --ahead-workers 2 "
        "--bytecode-cache`, the checkpoint + slab row with `--drop-page-cache`), LoRA r=16, AdamW, "
        "`stagehand.compile_blocks`; `vram_budget` Flux 16 GiB, Qwen-7B 20 GiB, Qwen-32B 40 GiB; cold: every cache "
        "empty, two ahead-compile workers started by `offload()`; warm: a second process on the same machine. "
        "The cold checkpoint + slab row's offload ran under cProfile (the bench profiles every cold offload from "
        "files). \"collector s\": Python's garbage collector from offload's end to the first step's end. "
        "\"new-plan steps / steady\": a cold run's steps 3 and 4 (the first two under the plan made from the "
        "calibration step), a warm run's step 2, over the steady step"),
        extra=[Col("collector s", _first_step_gc), Col("new-plan steps / steady", _new_plan_steps)])


def start_time_blocks_table(sources=START_TIME_SOURCES, what: str | None = None,
                            run: Callable[[dict], str] = lambda r: r["mode"], extra: list | None = None,
                            modes: tuple[str, ...] = ()) -> str:
    """Seconds to the first step: whole-model capture against a compile per block (`stagehand.compile_blocks`),
    the weights built in memory or read from the checkpoint and slab on disk; the resident model's regional
    compile beside them."""
    runs = []
    for name, rows in sources:
        for r in load(name)["runs"]:
            if r.get("row") in rows and "error" not in r and (not modes or r["mode"] in modes):
                runs.append(dict(r, _source=name))
    runs.sort(key=lambda r: ([k for _, rows in sources for k in rows].index(r["row"]),
                             ["coldprofile", "serial", "cold", "warm"].index(r["mode"])
                             if r["mode"] in ("coldprofile", "serial", "cold", "warm") else 9))
    model = {"flux": "Flux-dev 12B", "qwen": "Qwen2.5-7B shape", "qwen32": "Qwen2.5-32B shape"}

    def weights(r: dict) -> str:
        parts = r["row"].split(":")
        if parts[1] == "resident":
            return "resident (torch.compile, Inductor)"
        if "files" not in parts:
            return f"{parts[1]}, built in memory"
        cache = "page cache dropped" if r.get("page_cache") == "dropped" else "in the page cache"
        return f"{parts[1]}, checkpoint + slab on disk ({cache})"

    def units(r: dict) -> str:
        return f"{r['units_compiled_cold']} / {r['units_loaded']}" if "units_loaded" in r else ""

    cols = [Col("model", lambda r: model[r["row"].split(":")[0]]), Col("weights", weights),
            Col("compile", lambda r: "per block" if r["row"].endswith(":blocks") else "whole model"),
            Col("run", run), Col("offload s", field("offload_s", num, 1)),
            Col("first step s", field("first_step_s", num, 1)), Col("Dynamo capture s", field("dynamo_s", num, 1)),
            Col("units compiled / loaded", units), Col("their s", field("compile_seconds", num, 1)),
            Col("W8A16 autotune s", field("autotune_seconds", num, 1)),
            Col("steps 2-4 ms", lambda r: " / ".join(ms(v) for v in r["step_ms"][:3])),
            Col("steady ms", field("steady_ms", ms)), *(extra or []), Col("source", lambda r: f"`{r['_source']}`")]
    what = what or (
        "Each run a fresh process (`benches/start_time.py`), LoRA r=16, AdamW; `vram_budget` Flux 16 GiB, "
        "Qwen-7B 20 GiB, Qwen-32B 40 GiB; cold: every cache empty; warm: a second process on the same machine. "
        "\"per block\": `stagehand.compile_blocks(model)`. The checkpoint + slab rows build the model on the "
        "meta device and offload it from its safetensors checkpoint and INT8 slab (`keep_full=\"file\"`); their "
        "cold run drops the page cache first. Steps 2-4 of a cold run compile the units of the plan made from "
        "the calibration step")
    names = [name for name, _ in sources]
    return f"{caption(*names, what=what)}\n\n{table(runs, cols)}\n"


def moe_table(name: str = "moe_qwen3_30b.json") -> str:
    """The MoE LoRA step with streamed experts against its limits (benches/moe.py)."""
    data = load(name)
    rows = [r for r in data["rows"] if "error" not in r]
    cols = [Col("run", lambda r: r["mode"]), Col("step ms", field("step_ms", ms)),
            Col("H2D GB / step", field("h2d_gb_step", num, 1)),
            Col("H2D limit ms", field("h2d_limit_ms", ms)), Col("compute limit ms", field("compute_limit_ms", ms)),
            Col("step / larger limit", field("vs_limit", num, 2)),
            Col("x experts dense", field("vs_dense_experts", num, 3)), Col("peak GiB", field("peak_gib", num, 1)),
            Col("first step s", field("first_step_s", num, 1)),
            Col("sync fetches / step", field("sync_fetches_step", num, 0))]
    what = (f"transformers' Qwen3MoeForCausalLM at Qwen3-30B-A3B's shape ({data['params_b']}B parameters: 48 layers, "
            f"128 experts, top-8), LoRA r=16 on attention, AdamW, checkpointing, T={data['sequence']}; the resident "
            "row is the plain model on the GPU with each layer compiled by torch.compile (the compute limit); the "
            f"H2D limit is each row's H2D bytes per step at the pinned bandwidth measured in the run "
            f"({data['pinned_h2d_gbps']} GB/s); `stagehand.compile_blocks`, `vram_budget` per row; int8 stacks are "
            "multiplied from their bytes by the grouped kernel (the autotuner's pick against dequantize + "
            "`grouped_mm`), and the \"experts dense\" row compiles the same blocks with `experts_math=\"dense\"` "
            "(the stacks dequantized in the graph for the model's `grouped_mm`): \"x experts dense\" is the step "
            "over that row's")
    return f"{caption(name, what=what)}\n\n{table(rows, cols)}\n"


def multi_gpu_table(name: str) -> str:
    """Training on the GPUs of one node under DDP, one host store per node (benches/multi_gpu.py)."""
    data = load(name)
    cols = [Col("run", lambda r: r["mode"]), Col("step ms", field("step_ms", ms)),
            Col("samples / s", field("samples_s", num, 2)), Col("x 1 GPU", field("speedup", num, 2)),
            Col("x DeepSpeed step", field("x_deepspeed", num, 2)),
            Col("H2D limit ms", field("h2d_bound_ms", ms)),
            Col("host optimizer ms", lambda r: ms(r["host_optimizer_ms"]) if r.get("host_optimizer_ms") else ""),
            Col("node host memory GB (sum of Pss)", field("node_pss_gb", num, 1)),
            Col("x 1 GPU's", field("node_memory_vs_one", num, 2)),
            Col("largest rank RSS GB", field("max_rank_rss_gb", num, 1)),
            Col("page-locked GB per rank", field("pinned_locked_gb_per_rank", num, 1)),
            Col("first step s", field("first_step_s", num, 1))]
    if data["workload"] == "lora":
        what = ("diffusers' FluxTransformer2DModel at Flux-dev size, peft LoRA r=16 on attention, AdamW, "
                f"checkpointing, 4096 + 512 tokens, batch 1 per GPU, int8, `vram_budget` {data['budget_gib']:g} GiB per "
                "GPU")
    else:
        what = ("transformers' Qwen2ForCausalLM at Qwen2.5-7B's shape, every parameter trained, sequence 2048, batch 1 "
                f"per GPU, bf16 weights, `vram_budget` {data['budget_gib']:g} GiB per GPU, `HostAdamW` (fp32 master "
                "and moments; on 2 GPUs each block's on its owner), against DeepSpeed ZeRO-2 with "
                "`offload_optimizer: cpu` (bf16, its CPU Adam) on the same GPUs")
    what += ("; each row a fresh `torchrun` job, `compile_blocks` + `DistributedDataParallel` (NCCL), "
             "OMP_NUM_THREADS = cores / GPUs for every engine; node host memory: the ranks' Pss summed "
             "(/proc/<pid>/smaps_rollup: a page mapped by both ranks counts once); H2D limit: the streamed bytes "
             "per step at the bandwidth measured with every rank copying at once")
    return f"{caption(name, what=what)}\n\n{table(data['rows'], cols)}\n"


def moe_generate_table(name: str = "moe_generate.json") -> str:
    """Generation with streamed experts against accelerate's offload (benches/moe_generate.py)."""
    data = load(name)
    cols = [Col("run", lambda r: r["mode"]), Col("new tokens", field("new_tokens", num, 0)),
            Col("first token s", field("first_token_s", num, 2)), Col("tokens / s", field("tokens_per_s", num, 3)),
            Col("x accelerate", field("x_accelerate", num, 1)), Col("H2D GB / token", field("h2d_gb_token", num, 1)),
            Col("H2D limit tokens / s", field("h2d_limit_tokens_per_s", num, 2)),
            Col("expert cache entries", lambda r: r["expert_cache"]["entries"] if r.get("expert_cache", {}).get("entries") else ""),
            Col("cache hit rate", field("cache_hit_rate", num, 3)),
            Col("peak GiB allocated", field("peak_gib", num, 2))]
    on_cpu = sum(1 for v in data.get("accelerate_device_map", {}).values() if v == "cpu")
    what = (f"The Qwen3-30B-A3B shape (random init, bf16), batch 1, a {data['prompt_tokens']}-token prompt, greedy "
            f"`generate` with the KV cache, GPU budget {data['budget']}: stagehand `offload(..., vram_budget=...)`, "
            "no compile; each new token reads its layers and only the experts its router picked, through the "
            "device expert cache with the next block's guessed experts prefetched (the default; \"auto\" size, "
            "or `expert_cache_bytes=0`: its floor), or streams every block whole "
            "(`routed_experts_max_tokens=0`); a 2-token generation before each row (the autotuner's first calls; "
            "its experts stay cached); the prompt streams whole blocks and counts in the H2D a token; accelerate `infer_auto_device_map` with the same "
            f"GPU budget and `dispatch_model` ({on_cpu} of 48 layers run from host memory). Tokens a second over the "
            "tokens after the first")
    return f"{caption(name, what=what)}\n\n{table(data['rows'], cols)}\n"


def capture_split_table(name: str = "capture_split_cpu.json") -> str:
    """Dynamo's capture of a deep model, plain against offloaded (benches/capture_split.py)."""
    data = load(name)
    cols = [Col("model", lambda r: {"plain": "plain peft model, `backend=\"eager\"`",
                                    "stagehand": "offloaded, `backend=\"stagehand\"`"}[r["mode"]]),
            Col("first call s", field("first_call_s", num, 1)), Col("Dynamo's compile s", field("dynamo_compile_s", num, 1)),
            Col("its bytecode tracing s", field("dynamo_tracing_s", num, 1)),
            Col("its guards s", field("dynamo_guards_s", num, 1)),
            Col("stagehand's graph passes s", field("backend_graph_passes_s", num, 2)),
            Col("tracing x plain", field("tracing_x_plain")), Col("units (ATen) s", field("units_compile_s", num, 1))]
    what = (f"A Qwen2 shape of {data['layers']} layers (Qwen2.5-7B's depth) and width 128, peft LoRA, the first call "
            "(forward and backward) of a fresh process, profiled; the CPU was shared with other work, so the two "
            "processes' tracing differs by noise as much as by anything else")
    return f"{caption(name, what=what)}\n\n{table(data['rows'], cols)}\n"


def host_adamw_states(name: str = "host_adamw_states_cpu.json") -> str:
    """The host AdamW step per kind of state (benches/host_adamw_states.py)."""
    data = load(name)
    cols = [Col("master", lambda r: r["master"]), Col("moments", lambda r: r["states"]),
            Col("optimizer bytes a parameter (beside the bf16 weight)", field("optimizer_bytes_per_param")),
            Col("M parameters a second", field("mparams_per_s", num, 1)),
            Col("x fp32 master and moments", field("x_fp32_rate"))]
    what = (f"`adamw_step` over {data['rows'][0]['params_m']}M bf16 parameters (four Linear weights), the median "
            "of 5 steps, on this machine's threads (not measured on a GPU machine's host)")
    return f"{caption(name, what=what)}\n\n{table(data['rows'], cols)}\n"


PEER_FILES = ["peer_offload_flux.json", "peer_musubi_flux_h100.jsonl", "peer_musubi_flux_h200.jsonl"]


def musubi_rows(name: str) -> list[dict]:
    """peer_musubi_flux_*.jsonl: {label: {ms: [...], peak_gib, ...}} as rows (step_ms: the median)."""
    rows = []
    for key, r in load(name).items():
        if not isinstance(r, dict) or "ms" not in r:
            continue
        times = sorted(r["ms"])
        row = dict(r, step_ms=times[len(times) // 2], rss_gb=r.get("rss_gb"), pinned_gb=r.get("torch_pinned_gb"))
        if key.startswith("resident"):
            row.update(mode="resident (eager), LoRA as hooks", baseline="eager")
        else:
            swaps = re.search(r"swap(\d+)", key)
            split = r.get("double_single_swapped") or ["?", "?"]
            row["mode"] = (f"musubi-tuner's block swap, {swaps.group(1) if swaps else '?'} blocks swapped "
                           f"({split[0]} double + {split[1]} single streaming, ring of {load(name)['env'].get('ring')})")
        rows.append(row)
    return rows


def peer_label(row: dict) -> str:
    if row["_file"].startswith("budget_sweep"):
        return sweep_label(row) if baseline_kind(row) else "stagehand int8, " + sweep_label(row)
    return mode_words(row)


def peer_rows(with_models: bool = True) -> list[dict]:
    """Every Flux training set-up measured beside its own resident model, each row with its file and label."""
    rows = []
    if with_models:
        rows += [dict(r, _file="models_flux.json") for r in load("models_flux.json")["rows"]]
        rows += [dict(r, _file="budget_sweep_flux.json") for r in sweep_picks(load("budget_sweep_flux.json"))]
    rows += [dict(r, _file="peer_offload_flux.json", pinned_gb=r.get("torch_pinned_gb"))
             for r in load("peer_offload_flux.json")["rows"]]
    for n in PEER_FILES[1:]:
        rows += [dict(r, _file=n) for r in musubi_rows(n)]
    return [dict(r, _label=peer_label(r)) for r in rows]


def gpu_of(name: str) -> str:
    env = env_of(load(name))
    return (env.get("device") or env.get("gpu") or "").replace("NVIDIA ", "").replace(" HBM3", "")


def peers_table(headline: bool = False) -> str:
    rows = peer_rows()
    group = lambda r: r["_file"]  # noqa: E731
    bases = baselines(rows, group)
    if headline:  # stagehand's sweep rows, and each peer measured on the sweep's GPU (without its resident row)
        gpu = gpu_of("budget_sweep_flux.json")
        rows = [r for r in rows if r["_file"] != "models_flux.json" and gpu_of(r["_file"]) == gpu
                and not (baseline_kind(r) and r["_file"] != "budget_sweep_flux.json")]
    cols = [Col("tool, setting", lambda r: r["_label"]), *([] if headline else [Col("GPU", lambda r: gpu_of(r["_file"]))]),
            Col("step ms", field("step_ms", ms)), *ratio_cols(bases, group), Col("peak GiB", field("peak_gib")),
            Col("peak reserved GiB", field("peak_reserved_gib")), Col("note", note)]
    what = ("Flux-dev 12B, 4096 image + 512 text tokens, LoRA r=16 on the attention projections, AdamW, the "
            "model's gradient checkpointing on; each ratio is to the resident model of the same file (run)")
    return files_table(rows, cols, what)


def files_table(rows: list[dict], cols: list[Col], what: str) -> str:
    """Rows gathered from several result files (`_file`): the table with a file column, captioned by every file."""
    files = list(dict.fromkeys(r["_file"] for r in rows))
    file_col = Col("file", lambda r: f"`{r['_file']}`")
    return f"{caption(*files, what=what)}\n\n{table(rows, [*cols, file_col])}\n"


def host_memory_of_peers() -> str:
    rows = [r for r in peer_rows(with_models=False) if r.get("rss_gb") is not None]
    for r in load("host_memory_flux.json")["runs"]:
        rows.append(dict(r, _file="host_memory_flux.json", rss_gb=r.get("rss_train_gb"),
                         _label=f"stagehand {r['run'].split('@')[0].split(':')[0]}, `keep_full=\"{r['keep_full']}\"`"
                              + (f", inside a {r['cgroup_gb']:g} GB cgroup" if r.get("cgroup_gb") else "")))
    cols = [Col("tool, setting", lambda r: r["_label"]), Col("host RSS GB", field("rss_gb")),
            Col("page-locked GB", field("pinned_gb")), Col("GPU peak GiB", field("peak_gib"))]
    what = ("Host memory of the same Flux set-ups: RSS after the measured steps, and the page-locked bytes (for "
            "the peers, what PyTorch's pinned pool holds; for stagehand, its host store locked in place)")
    return files_table(rows, cols, what)


def diffusers_reset() -> str:
    """The line diffusers logs when it is asked for num_blocks_per_group > 1 with streams."""
    lines = [l.strip() for l in (RESULTS / "peer_offload_flux.log").read_text().splitlines() if "Setting it to" in l]
    if not lines:
        return f"`{REL}/peer_offload_flux.log` records no reset of `num_blocks_per_group`.\n"
    quote = re.sub(r"^.*?(Using streams)", r"\1", lines[0])
    return f"> {quote}\n\n(`{REL}/peer_offload_flux.log`)\n"


# ---- streaming, fp8, kernels ---------------------------------------------------------------------------------------


def streaming_table() -> str:
    data = load("streaming.json")
    rows = data["rows"]
    group = lambda r: r.get("tokens")  # noqa: E731
    bases = baselines(rows, group)
    cols = [Col("tokens", field("tokens")), Col("mode", lambda r: r.get("mode", "")),
            Col("step ms", field("step_ms", ms)), Col("host issue ms", field("host_ms", ms)),
            *ratio_cols(bases, group), Col("H2D GB / step", lambda r: num(r["h2d_gb_step"]) if r.get("h2d_gb_step") else ""),
            Col("H2D floor ms", lambda r: ms(r["floor_ms"]) if r.get("floor_ms") else ""),
            Col("x floor", lambda r: num(r["step_ms"] / r["floor_ms"]) if r.get("floor_ms") else ""),
            Col("peak GiB", field("peak_gib")), Col("peak reserved GiB", field("peak_reserved_gib")),
            Col("first step s", field("first_step_s", num, 1)),
            Col("sync fetches / step", lambda r: num(r.get("sync_fetches"), 0) if baseline_kind(r) is None else "")]
    what = (f"`dit-48x3072` training step (forward + backward, base frozen, batch 1), 48 blocks of "
            f"{data.get('block_mib', 0):g} MiB of bf16 Linear weights; pinned H2D measured "
            f"{data.get('pinned_h2d_gbps', 0):.1f} GB/s")
    return f"{caption('streaming.json', what=what)}\n\n{table(rows, cols)}\n"


def fp8_workload() -> str:
    data = load("fp8_workload_a.json")
    rows = data["rows"]
    group = lambda r: None  # noqa: E731
    bases = baselines(rows, group)
    cols = [Col("mode", lambda r: r.get("mode", "")), Col("step ms", field("step_ms", ms)),
            Col("host issue ms", field("host_ms", ms)), *ratio_cols(bases, group, "resident bf16"),
            Col("peak GiB", field("peak_gib")), Col("peak reserved GiB", field("peak_reserved_gib")),
            Col("first step s", field("first_step_s", num, 1)),
            Col("resident / streamed blocks", lambda r: f"{r['resident']} / {r['streamed']}" if "resident" in r else ""),
            Col("note", note)]
    shape = data.get("shape", {})
    what = (f"Workload A: {shape.get('blocks')} Flux single-stream blocks of 3072 at {shape.get('tokens_per_block')} "
            f"tokens ({data.get('params_b')}B parameters), LoRA r=16, AdamW")
    return f"{caption('fp8_workload_a.json', what=what)}\n\n{table(rows, cols)}\n"


def fp8_policy() -> str:
    data = load("fp8_workload_a.json")
    rows = (data.get("fp8_policy") or {}).get("rows", [])
    cols = [Col("Linear (out x in)", lambda r: f"{r['out_features']}x{r['in_features']}"), Col("tokens", field("tokens")),
            Col("bf16 ms", field("bf16_ms", num, 3)), Col("fp8 ms", field("fp8_ms", num, 3)),
            Col("fp8 speed-up", field("speedup"))]
    what = ("The FP8 policy file of the same run (forward + grad-input per Linear shape of the block; "
            f"written to `{REL}/fp8_policy_workload_a.json`)")
    return f"{caption('fp8_workload_a.json', what=what)}\n\n{table(rows, cols)}\n"


def fp8_parts() -> str:
    data = load("fp8_parts_h100.json")
    shapes = list(dict.fromkeys(r["shape"] for r in data["rows"]))
    pieces = list(dict.fromkeys(r["piece"] for r in data["rows"]))
    by = {(r["shape"], r["piece"]): r for r in data["rows"]}

    def cell(piece, shape, key, digits):
        r = by.get((shape, piece)) or {}
        return "error" if r.get("error") else num(r.get(key), digits)

    rows = [{"piece": p} for p in pieces]
    cols = [Col("piece", lambda r: r["piece"])]
    for s in shapes:
        cols.append(Col(f"{s} GPU ms", lambda r, s=s: cell(r["piece"], s, "gpu_ms", 4)))
        cols.append(Col(f"{s} host us", lambda r, s=s: cell(r["piece"], s, "host_us", 1)))
    what = (f"The pieces of an FP8 Linear at {data.get('tokens')} tokens, one at a time: GPU time (CUDA graph) and "
            "the host's time to issue it")
    return f"{caption('fp8_parts_h100.json', what=what)}\n\n{table(rows, cols)}\n"


def chosen_words(row: dict) -> str:
    chosen = row.get("chosen", "")
    if "mode='dequant'" in chosen:
        return "dequantize + cuBLAS"
    split = re.search(r"split=(\d+)", chosen)
    return "fused" + (f" split-K {split.group(1)}" if split and split.group(1) != "1" else "")


def kernels_table() -> str:
    data = load("kernels.json")
    rows = sorted(data["rows"], key=lambda r: (r["kind"] != "fwd", r["M"]))

    def target(r):
        if r.get("target") is None:
            return ""
        return f"{num(r['target'])} {'met' if r['ratio'] >= r['target'] else 'missed'}"

    cols = [Col("op", lambda r: {"fwd": "forward", "bwd": "grad-input"}.get(r["kind"], r["kind"])),
            Col("M", field("M")), Col("K x N", lambda r: f"{r['K']}x{r['N']}"),
            Col("cuBLAS bf16 us", field("cublas_us", num, 1)), Col("ours us", field("ours_us", num, 1)),
            Col("cuBLAS / ours", field("ratio")), Col("target", target),
            Col("torchao int8 weight-only us", field("torchao_int8wo_us", num, 1)),
            Col("`torch._weight_int8pack_mm` us", field("torch_int8pack_mm_us", num, 0)),
            Col("what runs", chosen_words), Col("ours GB/s", field("ours_GBps", num, 0)),
            Col("ours TFLOP/s", field("ours_TFLOPs", num, 0))]
    what = ("W8A16 forward and grad-input against cuBLAS bf16: GPU time from CUDA-graph replays over rotating weight "
            f"copies (more than twice L2, so weights arrive cold); device copy bandwidth {data.get('copy_GBps', 0):.0f} GB/s")
    return f"{caption('kernels.json', what=what)}\n\n{table(rows, cols)}\n"


def weight_layout() -> str:
    data = load("kernels_smem_weight_experiment.json")
    cols = [Col("op", lambda r: {"fwd": "forward", "bwd": "grad-input"}.get(r["kind"], r["kind"])),
            Col("M", field("M")), Col("K x N", lambda r: f"{r['K']}x{r['N']}"),
            Col("cuBLAS bf16 us", field("cublas_us", num, 1)),
            Col("int8 weight as the register operand us", field("register_weight_us", num, 1)),
            Col("int8 weight through shared memory us", field("smem_weight_us", num, 1))]
    return (f"{caption('kernels_smem_weight_experiment.json', what='The two layouts of the fused kernel')}\n\n"
            f"{table(data['rows'], cols)}\n")


def host_overhead() -> str:
    data = load("host_overhead.json")
    shape = data.get("shape", {})
    cols = [Col("call", lambda r: f"`{r['op']}`"), Col("host us per call", field("host_us_per_call", num, 1)),
            Col("x cuBLAS forward", field("vs_cuBLAS"))]
    what = (f"Host time to issue one call at M={shape.get('m')}, K={shape.get('k')}, N={shape.get('n')} "
            "(the replayed launch, the full launch path, and the `stagehand` op around it)")
    return f"{caption('host_overhead.json', what=what)}\n\n{table(data['rows'], cols)}\n"


def int8_accuracy() -> str:
    data = load("int8_accuracy.json")
    summary = data["summary"]
    rows = [dict(summary[q], quantizer=q) for q in ("absmax", "mse") if q in summary]
    cols = [Col("quantizer", lambda r: f"`{r['quantizer']}`"), Col("mean cosine per layer", field("mean", num, 7)),
            Col("min cosine per layer", field("min", num, 7)), Col("weight MSE", lambda r: f"{r['wmse']:.3g}" if r.get("wmse") is not None else ""),
            Col("model embedding cosine, mean", lambda r: num((r.get("model_embedding") or {}).get("mean"), 7))]
    what = (f"INT8 against bf16 outputs per Linear on real pretrained weights, {data.get('model')}, "
            f"{data.get('sentences')} sentences")
    return f"{caption('int8_accuracy.json', what=what)}\n\n{table(rows, cols)}\n"


def slab_build() -> str:
    data = load("slab_build.json")
    res, ck, host = data["result"], data["checkpoint"], data.get("host", {})
    rows = [{"checkpoint": f"{ck['checkpoint_bytes'] / 1e9:.2f} GB in {ck['shards']} shards",
             "slab": f"{res['slab_bytes'] / 1e9:.2f} GB, {res['layers']} layers",
             "delta": res["delta_mb"], "target": res["target_mb"], "seconds": res["build_seconds"]}]
    cols = [Col("checkpoint", lambda r: r["checkpoint"]), Col("slab", lambda r: r["slab"]),
            Col("peak RSS above the interpreter MB", field("delta", num, 0)),
            Col("target MB", field("target", num, 0)), Col("build s", field("seconds", num, 0))]
    where = f"CPU ({host.get('cpus', '?')} cores), python {host.get('python', '?')}, torch not recorded"
    return (f"`build_slab_from_checkpoint(blocks_only=True)` on a synthetic sharded bf16 checkpoint, quantizer "
            f"`{data.get('quantizer')}`. Source: `{REL}/slab_build.json`: {where}, commit not recorded.\n\n"
            f"{table(rows, cols)}\n")


# ---- convergence, host memory --------------------------------------------------------------------------------------

RUN_WORDS = {
    "bf16": "all bf16",
    "int8": "all int8",
    "dynamic": "dynamic, `precision=\"auto\"`",
    "dynamic_from_int8": "dynamic, starting map int8",
    "dynamic_fp8": "dynamic + fp8 allowed, `precision=\"auto\"`",
}


def convergence(name: str) -> str:
    data = load(name)
    cols = [Col("run", lambda r: RUN_WORDS.get(r["run"], r["run"])), Col("eval loss", field("eval_loss", num, 4)),
            Col("vs bf16", field("eval_vs_bf16_pct", pct, 2)), Col("train loss, last steps", field("final_loss", num, 4)),
            Col("weight MB / step", field("h2d_mb_per_step", num, 1)), Col("vs bf16 ", field("bytes_vs_bf16_pct", pct, 1)),
            Col("blocks bf16 / int8 / fp8 at the end",
                lambda r: f"{r.get('bf16_blocks')} / {r.get('int8_blocks')} / {r.get('fp8_blocks')}"),
            Col("switches", field("switches")), Col("step ms", field("step_ms", ms))]
    s = data.get("shape", {})
    what = (f"{data.get('steps')} LoRA steps on real text after {data.get('pretrain_steps')} steps of pretraining a "
            f"{s.get('layers')}-block Llama (hidden {s.get('hidden')}, sequence {s.get('seq')}, batch {s.get('batch')}), "
            "same seed and data order")
    overrides = data.get("sp_overrides") or {}
    if overrides:
        what += "; selective precision " + ", ".join(f"`{k}={v!r}`" for k, v in overrides.items())
    policy = data.get("fp8_policy")
    if policy:
        what += f"; FP8 policy file measured on the same GPU with {len(policy.get('rules', []))} rules"
    return f"{caption(name, what=what)}\n\n{table(data['rows'], cols)}\n"


def host_memory() -> str:
    names = ["host_memory_flux.json", "host_memory_qwen.json"]
    rows = []
    for n in names:
        data = load(n)
        rows += [dict(r, _model={"flux": "Flux 12B", "qwen": "Qwen 7B"}.get(data["model"], data["model"]))
                 for r in data["runs"]]

    def precision(r):
        return r["run"].split("@")[0].split(":")[0]

    cols = [Col("model", lambda r: r["_model"]), Col("precision", precision),
            Col("`keep_full`", lambda r: f"`\"{r['keep_full']}\"`"),
            Col("cgroup `memory.max` GB", lambda r: num(r.get("cgroup_gb"), 0) if r.get("cgroup_gb") else "none"),
            Col("page-locked GB (x streamed)", lambda r: f"{r['pinned_gb']:.2f} ({r['locked_vs_streamed']:.2f}x)"),
            Col("pinned per tensor, power-of-two rounded GB", field("old_pinned_gb")),
            Col("peak RSS loading / after GB", lambda r: f"{r['peak_rss_offload_gb']:.2f} / {r['rss_after_offload_gb']:.2f}"),
            Col("RSS training GB", field("rss_train_gb")),
            Col("cgroup `memory.peak` GB", field("memory_peak_gb")), Col("OOM kills", field("oom_kills")),
            Col("offload s", field("offload_s", num, 1)), Col("step ms", field("step_ms", ms)),
            Col("step ms, every master page-locked too", field("step_ms_all_pinned", ms))]
    what = ("The model saved with `save_pretrained`, built on the meta device and loaded with "
            "`offload(model, checkpoint=folder)`; each run a fresh process")
    return f"{caption(*names, what=what)}\n\n{table(rows, cols)}\n"


def disk_tier() -> str:
    data = load("host_memory_disk_tier_h100.json")
    cols = [Col("blocks", field("blocks")), Col("INT8 GB", field("int8_gb")),
            Col("page cache dropped", field("evicted")), Col("step ms, INT8 in RAM", field("step_ms_ram", ms)),
            Col("step ms, INT8 read from the slab", field("step_ms_disk", ms)), Col("x", field("ratio", num, 1)),
            Col("disk read GB/s", field("read_gbps"))]
    what = "`Config(int8_tier=\"disk\")`: Flux-single-shaped blocks read from the slab file at each fetch"
    return f"{caption('host_memory_disk_tier_h100.json', what=what)}\n\n{table(data['runs'], cols)}\n"


def gpu_test_logs() -> str:
    """Each GPU test log: the device and versions it records, and every pytest summary line in it as written, under
    the comment that names its run."""
    rows = []
    for path in sorted(RESULTS.glob("*tests*.log")):
        lines = path.read_text(errors="replace").splitlines()
        header, summary, run = [], [], ""
        if any(l.startswith("# summary of this run:") for l in lines):  # benches/device_run.sh: one run per log
            header = [l.lstrip("#! ").strip() for l in lines if re.match(r"# (!!! )?stage ", l)]
            summary = [l[2:].strip() for l in lines if l.startswith(("# summary of this run:", "# pytest exit"))]
        else:  # an older log: its own comments name the device and each run
            for line in lines:
                if line.startswith(("# device", "# torch")):
                    header.append(line[2:].strip())
                elif re.match(r"# (run|kernel tests)", line):
                    run = line[2:].split(": ", 1)[0].strip().rstrip(":")
                elif re.search(r"\b\d+ (passed|failed|error)", line) and re.search(r" in \d+(\.\d+)?s", line):
                    summary.append((f"{run}: " if run else "") + line.strip("= ").strip())
        rows.append({"log": f"`{REL}/{path.name}`", "header": "; ".join(header) or "not recorded",
                     "summary": "<br>".join(summary) or "no pytest summary line"})
    cols = [Col("log", lambda r: r["log"]), Col("device and versions it records", lambda r: r["header"]),
            Col("pytest summary lines, as written (after the run the log names)", lambda r: r["summary"])]
    return ("Every GPU test log under `benches/results/`, quoted: a log with several summary lines holds several "
            f"pytest runs, each counted on its own.\n\n{table(rows, cols)}\n")


# ---- figures from the code: the quick start's offload report, the demo's shapes ------------------------------------


def offload_report() -> str:
    """What the quick start prints when it offloads and runs its first training step, on the CPU."""
    import torch

    source = (ROOT / "examples" / "quickstart.py").read_text()
    head = source.split("\nfor step in", 1)[0]
    if "torch.cuda.is_available()" not in head or "rt = stagehand.offload(" not in head:
        raise RuntimeError("offload_report: examples/quickstart.py no longer reads as this figure expects")
    head = head.replace("torch.cuda.is_available()", "False")  # the CPU, on any machine
    out = io.StringIO()
    scope: dict = {}
    with warnings.catch_warnings(), contextlib.redirect_stderr(out):
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        try:
            exec(compile(head, "examples/quickstart.py", "exec"), scope)
            loss = scope["compiled"](**scope["batch"]).loss
            loss.backward()
            scope["optimizer"].step()
        finally:
            if "rt" in scope:
                scope["rt"].restore()
            torch._dynamo.reset()
    lines = [l for l in out.getvalue().splitlines() if l.startswith(("stagehand", "  "))]
    return "```\n" + "\n".join(lines) + "\n```\n"


def normalise_seconds(text: str) -> str:
    # The first-step line names only the phases that took 5 ms or more (on a loaded machine the optimizer's
    # joins them), offload's line only the stages that took 0.05 s or more. Which ones they list is timing, like
    # the seconds.
    text = PHASES.sub("first step took N s (phases)", SECONDS.sub("N s", text))
    return STAGES.sub("  took N s (stages)", text)


def demo_shapes() -> str:
    from torch_stagehand.app.demo import CPU_SHAPE, GPU_SHAPE

    shapes = {"CPU (the default without a GPU)": CPU_SHAPE, "GPU": GPU_SHAPE}
    rows = [{"what": "model"}, {"what": "batch x sequence, steps"}, {"what": "inner compiler"}]
    cols = [Col("", lambda r: r["what"])]
    for label, s in shapes.items():
        cells = {"model": f"{s.layers} blocks, hidden {s.hidden}, {s.dtype}",
                 "batch x sequence, steps": f"{s.batch} x {s.seq}, {s.steps}", "inner compiler": s.inner}
        cols.append(Col(label, lambda r, c=cells: c[r["what"]]))
    return table(rows, cols) + "\n"


# ---- the registry --------------------------------------------------------------------------------------------------


def full_finetune(name: str) -> str:
    """Full fine-tuning rows of one run (benches/full_finetune.py): step, memory, the limits beside stagehand."""
    data = load(name)
    rows = data["rows"]
    cols = [Col("mode", lambda r: r.get("mode", "")), Col("step ms", field("step_ms", ms)),
            Col("x DeepSpeed ZeRO-2 (same run)", field("x_best_deepspeed")),
            Col("GPU peak GiB", field("peak_gib")), Col("GPU peak reserved GiB", field("peak_reserved_gib")),
            Col("host peak RSS GB", field("peak_rss_gb", num, 1)),
            Col("H2D limit ms", field("limit_h2d_ms", ms)), Col("D2H limit ms", field("limit_d2h_ms", ms)),
            Col("host optimizer ms", field("limit_host_optimizer_ms", ms)),
            Col("x slowest limit", field("x_slowest_limit")),
            Col("blocks stepped during backward", field("blocks_stepped_in_backward_per_step", num, 0)),
            Col("blocks updated on the GPU", lambda r: str(len(r["device_blocks"])) if "device_blocks" in r else ""),
            Col("", lambda r: r.get("error", ""))]
    layers = data.get("layers")
    if data.get("model") == "flux":
        shape = "Flux-dev 12B (diffusers), 4096 + 512 tokens"
    else:
        shape = f"Qwen2.5-7B's width, {layers} of its 28 layers" if layers else "Qwen2.5-7B shape"
        shape += ", sequence 2048"
    states = f"; HostAdamW's master {data['master']}, moments {data['states']}" if data.get("master") else ""
    ckpt = ", the model's activation checkpointing" if data.get("checkpointing") else ""
    what = (f"{shape}{ckpt}, every parameter trained, AdamW (lr {data.get('lr')}), bf16 weights{states}; one "
            f"process per row; median of {data.get('steps')} steps")
    return f"{caption(name, what=what)}\n\n{table(rows, cols)}\n"


def soak(name: str = "soak_qwen7b.json") -> str:
    """The soak (benches/soak.py): each budget visit's settled step times and the memory at its end."""
    data = load(name)
    args = data["args"]
    cols = [Col("visit", field("visit", str)), Col("budget GiB", field("budget_gib", num, 0)),
            Col("resident blocks", field("resident_blocks", str)), Col("settled steps", field("settled", str)),
            Col("p50 ms", field("p50_ms", ms)), Col("p99 ms", field("p99_ms", ms)),
            Col("p99 / p50", field("p99_over_p50", num, 2)), Col("host RSS GB", field("rss_gb", num, 2)),
            Col("page-locked GB", field("pinned_gb", num, 2)), Col("GPU allocated GB", field("gpu_alloc_gb", num, 2)),
            Col("growth since the last visit: RSS / locked / GPU GB",
                lambda r: " / ".join(num(r[k], 3) for k in ("rss_growth_gb", "pinned_growth_gb", "gpu_growth_gb"))
                if "rss_growth_gb" in r else "")]
    cols.insert(7, Col("slow steps (> 1.15 x p50): with a full GC", lambda r: f"{r['slow_steps']}: {r['slow_with_full_gc']}"))
    soak_steps = sum(v["steps"] for v in data["visits"])
    what = (f"Qwen2.5-7B shape, int8 with bf16 kept in RAM, LoRA r=16 on attention, T=2048, AdamW, one process: "
            f"{soak_steps} steps, the budget moved every {args['every']} steps, the map switched every "
            f"{args['switch_every']} ({args['switch_blocks']} blocks to bf16, the window moving; {data['switches']} "
            f"switches); settled: not the {args['settle']} steps after a change")
    return f"{caption(name, what=what)}\n\n{table(data['visits'], cols)}\n"


def soak_oom(name: str = "soak_oom.json") -> str:
    """The soak's out-of-memory phase: what each injection cost, what the runtime did, whether the steps ran."""
    data = load(name)
    rows = []
    for phase in data["oom"]:
        recovered = [w for w in phase["warnings"] if "ran it again" in w]
        rerun = [w for w in phase["warnings"] if "must be run again" in w]
        rows.append({"phase": phase["phase"], "units run again in the step": len(recovered),
                     "steps that raised (run again by the loop)": len(phase["raised"]) and len(rerun),
                     "steps done": phase["steps_done"], "losses finite": phase["losses_finite"],
                     "plan after": phase["plan_after"].split(";")[0]})
    cols = [Col(k, field(k, str)) for k in rows[0]]
    what = ("The soak's model (Qwen2.5-7B shape, int8, LoRA, T=2048) at 16 GiB, then a second process takes all but "
            f"{data['args']['room_gib']:.0f} GiB between two steps; then a memory fraction of "
            f"{data['args']['room_gib']:.0f} GiB; {data['args']['oom_steps']} steps each, a step that raised run again "
            f"with the same batch; allocator: {data.get('allocator')}")
    return f"{caption(name, what=what)}\n\n{table(rows, cols)}\n"


@dataclass
class Figure:
    make: Callable[[], str]
    sources: tuple[str, ...]
    normalise: Callable[[str], str] = lambda text: text


FIGURES: dict[str, Figure] = {
    "sweep_flux": Figure(lambda: sweep("budget_sweep_flux.json"), ("budget_sweep_flux.json",)),
    "sweep_qwen": Figure(lambda: sweep("budget_sweep_qwen.json"), ("budget_sweep_qwen.json",)),
    "headline": Figure(lambda: peers_table(headline=True), ("budget_sweep_flux.json", *PEER_FILES)),
    "headline_qwen": Figure(headline_qwen, ("budget_sweep_qwen.json",)),
    "models": Figure(models_table, ("models_flux.json", "models_qwen.json")),
    "first_step": Figure(first_step_table, ("models_qwen_firststep_run1.json", "models_qwen_firststep_run2.json")),
    "start_time": Figure(start_time_table, ("start_time_mixed.json",)),
    "start_time_blocks": Figure(start_time_blocks_table, tuple(name for name, _ in START_TIME_SOURCES)),
    "start_time_now": Figure(start_time_now_table, tuple(name for name, _ in START_TIME_NOW)),
    "start_time_bytecode": Figure(start_time_bytecode_table, ("start_time_session_bytecode.json",)),
    "start_time_workers": Figure(start_time_workers_table, tuple(name for name, _ in START_TIME_WORKERS)),
    "start_time_freeze": Figure(start_time_freeze_table, tuple(name for name, _ in START_TIME_FREEZE)),
    "start_time_deferred": Figure(start_time_deferred_table, tuple(name for name, _ in START_TIME_DEFERRED)),
    "start_time_shortlist": Figure(start_time_shortlist_table, tuple(name for name, _ in START_TIME_SHORTLIST)),
    "start_time_one_config": Figure(start_time_one_config_table, tuple(name for name, _ in START_TIME_ONE_CONFIG)),
    "start_time_hints": Figure(start_time_hints_table, tuple(name for name, _, _ in START_TIME_HINTS)),
    "start_time_provisional": Figure(start_time_provisional_table,
                                     tuple(name for name, _, _ in START_TIME_PROVISIONAL)),
    "start_time_slab": Figure(start_time_slab_table, (*[n for n, _, r in START_TIME_SLAB],
                                                       *[r for _, _, r in START_TIME_SLAB if r])),
    "start_time_read_ahead": Figure(start_time_read_ahead_table, (*[n for n, _, _ in START_TIME_READ_AHEAD],
                                                                   *sorted({d for _, _, d in START_TIME_READ_AHEAD}))),
    "preparation_probe": Figure(preparation_probe_table, ("preparation_probe.json",)),
    "start_time_slab_open": Figure(start_time_slab_open_table, (*[n for n, _, _ in START_TIME_SLAB_OPEN],
                                                                 *sorted({d for _, _, d in START_TIME_SLAB_OPEN}))),
    "start_time_reads": Figure(start_time_reads_table, (*[n for n, _, _ in START_TIME_READS],
                                                         *sorted({d for _, _, d in START_TIME_READS if d}))),
    "start_time_behind": Figure(start_time_behind_table, (*[n for n, _, _ in START_TIME_BEHIND],
                                                           *sorted({d for _, _, d in START_TIME_BEHIND}))),
    "start_time_replans": Figure(start_time_replans_table, tuple(n for n, _, _, _ in START_TIME_REPLANS)),
    "slab_reads_process": Figure(slab_reads_process_table, ("slab_reads_process_h100.json",
                                                            "slab_reads_process_cpu.json")),
    "start_time_new_plan": Figure(start_time_new_plan_table, tuple(n for n, _ in START_TIME_NEW_PLAN)),
    "start_time_latest": Figure(start_time_latest_table, tuple(n for n, _, _ in START_TIME_LATEST)),
    "start_time_warm_bf16": Figure(start_time_warm_bf16_table, tuple(n for n, _ in START_TIME_WARM_BF16)),
    "start_time_rblock": Figure(start_time_rblock_table, tuple(n for n, _, _ in START_TIME_RBLOCK)),
    "slab_reads": Figure(slab_reads_table, ("slab_reads.json", "slab_reads_switch.json", "slab_reads_read_ahead.json")),
    "capture_split": Figure(capture_split_table, ("capture_split_cpu.json",)),
    "moe": Figure(moe_table, ("moe_qwen3_30b.json",)),
    "moe_generate": Figure(moe_generate_table, ("moe_generate.json",)),
    "multi_gpu_flux": Figure(lambda: multi_gpu_table("multi_gpu_flux.json"), ("multi_gpu_flux.json",)),
    "multi_gpu_qwen_fullft": Figure(lambda: multi_gpu_table("multi_gpu_qwen_fullft.json"),
                                    ("multi_gpu_qwen_fullft.json",)),
    "host_adamw_states": Figure(host_adamw_states, ("host_adamw_states_cpu.json",)),
    "peers_flux": Figure(peers_table, ("models_flux.json", "budget_sweep_flux.json", *PEER_FILES)),
    "peers_host_memory": Figure(host_memory_of_peers, (*PEER_FILES, "host_memory_flux.json")),
    "diffusers_reset": Figure(diffusers_reset, ("peer_offload_flux.log",)),
    "streaming": Figure(streaming_table, ("streaming.json",)),
    "fp8_workload": Figure(fp8_workload, ("fp8_workload_a.json",)),
    "fp8_policy": Figure(fp8_policy, ("fp8_workload_a.json",)),
    "fp8_parts": Figure(fp8_parts, ("fp8_parts_h100.json",)),
    "kernels": Figure(kernels_table, ("kernels.json",)),
    "weight_layout": Figure(weight_layout, ("kernels_smem_weight_experiment.json",)),
    "host_overhead": Figure(host_overhead, ("host_overhead.json",)),
    "int8_accuracy": Figure(int8_accuracy, ("int8_accuracy.json",)),
    "slab_build": Figure(slab_build, ("slab_build.json",)),
    "convergence": Figure(lambda: convergence("convergence_h100.json"), ("convergence_h100.json",)),
    "convergence_from_int8": Figure(lambda: convergence("convergence_from_int8_h100.json"),
                                    ("convergence_from_int8_h100.json",)),
    "convergence_ambiguous_int8": Figure(lambda: convergence("convergence_ambiguous_int8_h100.json"),
                                         ("convergence_ambiguous_int8_h100.json",)),
    "host_memory": Figure(host_memory, ("host_memory_flux.json", "host_memory_qwen.json")),
    "disk_tier": Figure(disk_tier, ("host_memory_disk_tier_h100.json",)),
    "gpu_test_logs": Figure(gpu_test_logs, ("*tests*.log",)),
    "offload_report": Figure(offload_report, ("examples/quickstart.py (run on the CPU)",), normalise_seconds),
    "demo_shapes": Figure(demo_shapes, ("stagehand/app/demo.py",)),
    "full_finetune_qwen": Figure(lambda: full_finetune("full_finetune_qwen.json"), ("full_finetune_qwen.json",)),
    "full_finetune_qwen_deepspeed": Figure(lambda: full_finetune("full_finetune_qwen_deepspeed.json"),
                                           ("full_finetune_qwen_deepspeed.json",)),
    "soak": Figure(soak, ("soak_qwen7b.json",)),
    "soak_gc_walks": Figure(lambda: soak("soak_qwen7b_gc_walks.json"), ("soak_qwen7b_gc_walks.json",)),
    "soak_oom": Figure(soak_oom, ("soak_oom.json",)),
    "soak_restore": Figure(lambda: soak("soak_qwen7b_restore.json"), ("soak_qwen7b_restore.json",)),
    "full_finetune_qwen14": Figure(lambda: full_finetune("full_finetune_qwen14.json"), ("full_finetune_qwen14.json",)),
    **{f"full_finetune_{run}": Figure(lambda run=run: full_finetune(f"full_finetune_{run}.json"),
                                      (f"full_finetune_{run}.json",))
       for run in ("qwen_3ec649d", "qwen_0ca7be8", "qwen14_3ec649d", "qwen14_dpu", "flux")},
}


# ---- documents: find, check, write ---------------------------------------------------------------------------------


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


@dataclass
class Problem:
    doc: str
    block: str  # the figure's name, or "" for a cited path
    what: str

    def __str__(self) -> str:
        return f"{self.doc}: " + (f"block figures:{self.block}: " if self.block else "") + self.what


class Renderer:
    """Each figure made once per run of the check (a document may quote one figure twice)."""

    def __init__(self):
        self.made: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if name not in self.made:
            self.made[name] = FIGURES[name].make()
        return self.made[name]


def _structure_problems(doc: str, text: str) -> list[Problem]:
    problems, open_name = [], None
    for m in OPENER.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        if not closing and open_name is None:
            open_name = name
        elif closing and name == open_name:
            open_name = None
        else:
            what = f"closes figures:{name} while figures:{open_name} is open" if closing and open_name else \
                f"closes figures:{name}, which is not open" if closing else f"opens inside figures:{open_name}"
            problems.append(Problem(doc, name, what))
    if open_name is not None:
        problems.append(Problem(doc, open_name, "is never closed (<!-- /figures:NAME -->)"))
    return problems


def check_text(doc: str, text: str, render: Renderer, root: Path = ROOT) -> list[Problem]:
    """What is wrong in one document: blocks that differ from their files, bad blocks, cited files missing."""
    problems = _structure_problems(doc, text)
    for m in BLOCK.finditer(text):
        name, body = m.group("name"), m.group("body")
        if name not in FIGURES:
            problems.append(Problem(doc, name, f"no such figure (known: {', '.join(FIGURES)})"))
            continue
        try:
            want = render(name)
        except Exception as e:  # noqa: BLE001 - a file that is gone or changed shape: say which block needs it
            problems.append(Problem(doc, name, f"cannot be made from {', '.join(FIGURES[name].sources)}: "
                                               f"{type(e).__name__}: {e}"))
            continue
        norm = FIGURES[name].normalise
        if norm(body) != norm(want):
            problems.append(Problem(doc, name, "differs from what its files give now: " + first_difference(body, want)
                                    + " (python benches/figures.py --write)"))
    for path in sorted(set(CITED.findall(text))):
        path = path.rstrip(".")
        if "*" in path or "<" in path:
            continue  # a pattern, not a file
        if not (root / path).exists():
            problems.append(Problem(doc, "", f"cites {path}, which does not exist"))
    return problems


def first_difference(have: str, want: str) -> str:
    a, b = have.splitlines(), want.splitlines()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"line {i + 1} of the block reads {x[:160]!r}, its files give {y[:160]!r}"
    return f"the block has {len(a)} lines, its files give {len(b)}"


def check(docs: list[Path] | None = None, root: Path = ROOT, render: Renderer | None = None) -> list[Problem]:
    render = render or Renderer()
    problems = []
    for path in docs or documents(root):
        doc = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        problems += check_text(doc, path.read_text(), render, root)
    return problems


def write(docs: list[Path] | None = None, root: Path = ROOT, render: Renderer | None = None) -> list[str]:
    """Regenerate every block; returns "doc: name" for each block that changed."""
    render = render or Renderer()
    changed = []
    for path in docs or documents(root):
        text = path.read_text()

        def fill(m):
            name = m.group("name")
            if name not in FIGURES:
                return m.group(0)
            want = render(name)
            if FIGURES[name].normalise(m.group("body")) == FIGURES[name].normalise(want):
                return m.group(0)  # the same figures (times aside): leave the block as it is
            changed.append(f"{path.relative_to(root)}: {name}")
            return f"<!-- figures:{name} -->\n{want}<!-- /figures:{name} -->"

        new = BLOCK.sub(fill, text)
        if new != text:
            path.write_text(new)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="(default) exit 1 when a block or a cited path is wrong")
    mode.add_argument("--write", action="store_true", help="regenerate every block in README.md and docs/")
    mode.add_argument("--list", action="store_true", help="each figure and the files it reads")
    mode.add_argument("--show", metavar="NAME", help="print one figure")
    args = parser.parse_args(argv)
    if args.list:
        for name, fig in FIGURES.items():
            print(f"{name:28s} {', '.join(fig.sources)}")
        return 0
    if args.show:
        if args.show not in FIGURES:
            parser.error(f"no figure {args.show!r} (known: {', '.join(FIGURES)})")
        print(FIGURES[args.show].make(), end="")
        return 0
    render = Renderer()
    if args.write:
        changed = write(render=render)
        print("\n".join(f"wrote {c}" for c in changed) or "every block is up to date")
    problems = check(render=render)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s); `python benches/figures.py --write` regenerates the blocks", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
