"""The figures README.md and docs/ quote, generated from the files that hold them.

A document quotes a figure through a generated block:

    <!-- figures:NAME -->
    ...what FIGURES[NAME] gives, written by --write...
    <!-- /figures:NAME -->

    python benches/figures.py            # --check (the default): exit 1 naming every block that differs from what
                                         # its files give now, every unknown or unclosed block, every cited
                                         # benches/results/... path that does not exist, every block that reads a
                                         # result file with no commit and clean tree, and every figure in prose
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

Two rules keep a document's figures from drifting away from their runs:

- Every measured number a reader sees comes from a generated block. A number with a unit of time, size, rate, share
  or ratio in a document's prose (`PROSE_FIGURE`: outside generated blocks, fenced code and inline code spans) is a
  problem naming the document, the line and the figure. A setting a user types goes in inline code
  (`vram_budget="16GiB"`), which the rule does not read.
- A block reads only runs that say what they ran: each result file of its figure is a JSON whose `env` records a
  40-hex `commit` and `tree: "clean"`, or a `.log` that opens with the `# stage ... | commit <40 hex> | clean tree |`
  header benches/device_run.sh writes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
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


COMMIT = re.compile(r"[0-9a-f]{40}")
LOG_HEADER = re.compile(r"# stage \S+ \| commit [0-9a-f]{40} \| clean tree \| ")  # benches/device_run.sh's first line


def unrecorded(name: str) -> str | None:
    """Why the result file NAME does not say which code ran it (a 40-hex commit and a clean tree), or None."""
    if name.endswith(".log"):
        first = (RESULTS / name).read_text(errors="replace").split("\n", 1)[0]
        return None if LOG_HEADER.match(first) else \
            "does not open with the `# stage ... | commit <40 hex> | clean tree | ...` header"
    try:
        env = env_of(load(name))
    except (ValueError, AttributeError):
        return "is not a JSON file with an `env`"
    if not COMMIT.fullmatch(str(env.get("commit") or "")):
        return "records no 40-hex commit in its `env`"
    if env.get("tree") != "clean":
        return f"records tree {env.get('tree')!r} in its `env`, not \"clean\""
    return None


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


# ---- what to expect: the budget sweeps' headline rows -------------------------------------------------------------

HEADLINE_SWEEPS = ("budget_sweep_flux.json", "budget_sweep_qwen.json")
SHORT_MODELS = {"flux": "Flux-dev 12B", "qwen": "Qwen2.5-7B shape"}


def headline() -> str:
    """Each model's resident baselines, no budget, its fastest budget and its smallest, from the budget sweeps."""
    rows = []
    for name in HEADLINE_SWEEPS:
        data = load(name)
        model = SHORT_MODELS.get(data.get("model"), str(data.get("model", "")))
        rows += [dict(r, _file=name, _model=model) for r in sweep_picks(data)]
    group = lambda r: r["_file"]  # noqa: E731 - sweep_picks keeps only the baselines at the sweep's checkpointing
    bases = baselines(rows, group)

    def setting(r: dict) -> str:
        return sweep_label(r) if baseline_kind(r) else f"stagehand int8, {sweep_label(r)}"

    cols = [Col("model", lambda r: r["_model"]), Col("setting", setting), Col("step ms", field("step_ms", ms)),
            *ratio_cols(bases, group), Col("peak GiB", field("peak_gib")),
            Col("peak reserved GiB", field("peak_reserved_gib"))]
    what = ("LoRA r=16, AdamW; " + "; ".join(model_words(load(n)) for n in HEADLINE_SWEEPS)
            + "; each ratio is to the resident model (every weight on the GPU) of the same run")
    return f"{caption(*HEADLINE_SWEEPS, what=what)}\n\n{table(rows, cols)}\n"


# ---- Flux LoRA beside the peers, like for like ---------------------------------------------------------------------

FLUX_PEER_RUNS = ("budget_sweep_flux_bf16_16.json", "budget_sweep_flux_int8_16.json", "peer_musubi_flux_eager.jsonl",
                  "peer_musubi_flux_compiled.jsonl", "peer_offload_flux.json")


def flux_peers() -> str:
    """Flux-dev LoRA at one memory size: stagehand bf16 beside the bf16 peers, stagehand int8 beside musubi-tuner's
    fp8 mode; each tool's compiled and eager rows, each ratio to that tool's own resident run (same LoRA, same
    loop), the recompute of each row said."""
    sweeps = {name: load(name) for name in FLUX_PEER_RUNS[:2]}
    bf16_rows = {r["mode"]: r for r in sweeps["budget_sweep_flux_bf16_16.json"]["rows"]}
    int8_rows = {r["mode"]: r for r in sweeps["budget_sweep_flux_int8_16.json"]["rows"]}
    musubi = {**{k: v for k, v in load("peer_musubi_flux_eager.jsonl").items() if ":" in k},
              **{k: v for k, v in load("peer_musubi_flux_compiled.jsonl").items() if ":" in k}}
    group = load("peer_offload_flux.json")["rows"]
    all_ckpt = "all 57 (the model's checkpointing)"
    sh_base = {"inductor": bf16_rows.get("resident (inductor, regional)"), "eager": bf16_rows.get("resident (eager)")}
    mu_base = {"inductor": musubi.get("bf16:0:compiled"), "eager": musubi.get("bf16:0:eager")}
    mu_fp8_base = {"inductor": musubi.get("fp8:0:compiled")}  # no eager fp8 resident run: its eager row has none
    rows = []

    def add(tool, what, precision, compiled, row, base, recompute):
        if row is None:
            return
        rows.append(dict(row, _tool=tool, _what=what, _precision=precision, _compiled=compiled, _recompute=recompute,
                         _base=base.get("inductor" if compiled != "eager" else "eager")))

    budget = lambda r: f"{r['recomputed']} of 57; {r['resident']} blocks resident" if r else ""  # noqa: E731
    add("(resident)", "every weight on the GPU, peft LoRA", "bf16", "eager", sh_base["eager"], sh_base, all_ckpt)
    add("(resident)", "every weight on the GPU, peft LoRA", "bf16", "regional", sh_base["inductor"], sh_base, all_ckpt)
    add("stagehand", "`vram_budget=16 GiB`", "bf16", "stagehand", bf16_rows.get("budget 16.0 GiB"), sh_base,
        budget(bf16_rows.get("budget 16.0 GiB")))
    add("stagehand", "`vram_budget=16 GiB`", "int8", "stagehand", int8_rows.get("budget 16.0 GiB"), sh_base,
        budget(int8_rows.get("budget 16.0 GiB")))
    add("musubi-tuner (resident)", "every weight on the GPU, its hook LoRA", "bf16", "eager", mu_base["eager"],
        mu_base, all_ckpt)
    add("musubi-tuner (resident)", "every weight on the GPU, its hook LoRA", "bf16", "per block",
        mu_base["inductor"], mu_base, all_ckpt)
    add("musubi-tuner (resident)", "every weight on the GPU, its hook LoRA", "fp8_scaled", "per block",
        musubi.get("fp8:0:compiled"), mu_fp8_base, all_ckpt)
    for key, what, precision, base in (("bf16:18", "`blocks_to_swap 18`, H2D-only, pinned", "bf16", mu_base),
                                       ("fp8:6", "`blocks_to_swap 6`, H2D-only, pinned", "fp8_scaled", mu_fp8_base)):
        add("musubi-tuner", what, precision, "eager", musubi.get(f"{key}:eager"), base, all_ckpt)
        add("musubi-tuner", what, precision, "per block, Linears left out", musubi.get(f"{key}:compiled"), base,
            all_ckpt)
    for r in group:
        compiled = "regional" if r.get("compiled") == "regional" or "regional" in r.get("mode", "") else "eager"
        add("diffusers", "group offload, 1 block a group, `use_stream`", "bf16", compiled, r, {}, all_ckpt)

    cols = [Col("tool", lambda r: r["_tool"]), Col("set-up", lambda r: r["_what"]),
            Col("weights", lambda r: r["_precision"]), Col("compiled", lambda r: r["_compiled"]),
            Col("step ms", field("step_ms", ms)), Col("x its own resident", lambda r: ratio(r, r["_base"])),
            Col("GPU peak GiB", field("peak_gib")), Col("GPU peak reserved GiB", field("peak_reserved_gib")),
            Col("blocks recomputed", lambda r: r["_recompute"]),
            Col("", lambda r: (r.get("error") or "").splitlines()[-1][:160] if r.get("error") else "")]
    what = ("Flux-dev 12B (diffusers, random init), 4096 image + 512 text tokens, LoRA r=16 on the attention "
            "projections, an AdamW step on the LoRA parameters, median of 3 steps; compiled: regional = each "
            "repeated block under torch.compile's defaults, per block = musubi-tuner's `--compile` (with a swap "
            "it leaves the swapped Linears out), stagehand = `torch.compile(backend=\"stagehand\")`; each ratio is "
            "to the same tool's resident run of the same weights compiled the same way (eager to eager; musubi-tuner's "
            "fp8 has no eager resident run, diffusers' rows have none of their own); stagehand int8's is the bf16 "
            "resident of the same call")
    return f"{caption(*FLUX_PEER_RUNS, what=what)}\n\n{table(rows, cols)}\n"


# ---- seconds to the first step -------------------------------------------------------------------------------------


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


# Each model's latest runs with two ahead-compile workers: (file, model, weights).
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
    """Offload and the first step, cold and warm, and the steady step: each model's latest runs."""
    rows = [dict(r, _model=model, _weights=weights, _source=name)
            for name, model, weights in START_TIME_LATEST for r in load(name)["runs"]]
    cols = [Col("model", lambda r: r["_model"]), Col("weights", lambda r: r["_weights"]),
            Col("run", lambda r: r["mode"]), Col("offload s", field("offload_s")),
            Col("first step s", field("first_step_s")),
            Col("offload + first step s", lambda r: num(r["offload_s"] + r["first_step_s"])),
            Col("steady ms", lambda r: ms(r["steady_ms"])), Col("source", lambda r: f"`{r['_source']}`")]
    what = ("Seconds to the first training step with `stagehand.compile_blocks` and two ahead-compile workers started "
            "by `offload()` (`benches/start_time.py --rows <row> --modes cold warm --ahead-workers 2 --bytecode-cache`, "
            "the checkpoint + slab rows with `--drop-page-cache`), LoRA r=16, AdamW, `vram_budget` Flux 16 GiB, "
            "Qwen-7B 20 GiB, Qwen-32B 40 GiB; each run a fresh process, each file's runs on one machine (its "
            "caption names the GPU); cold: every cache empty; warm: a second process on the same machine; steady: "
            "the median of the last three steps")
    return f"{caption(*[n for n, _, _ in START_TIME_LATEST], what=what)}\n\n{table(rows, cols)}\n"


# The documented call as a user runs it (offload, then torch.compile(model, backend="stagehand"), default settings,
# no environment variables): (file, rows taken from it). Each file one device call.
START_TIME_DEFAULT = (("start_time_default_flux.json", ("flux:int8:files", "flux:int8")),
                      ("start_time_default_mixed.json", ("flux:int8", "qwen:int8")),
                      ("start_time_default_a2094c3.json", ("flux:int8:files",)),
                      ("start_time_default_ca3693e.json", ("qwen:int8",)))
# Issue 58's targets, seconds: (row, what is timed) -> (cold, warm).
START_TIME_TARGETS = {"flux:int8:files": ("offload + first step", 20, 8), "flux:int8": ("first step", 15, 5),
                      "qwen:int8": ("offload + first step", 15, 5)}


def start_time_default_table(sources=START_TIME_DEFAULT) -> str:
    """Seconds to the first step of the documented call, each run a fresh process, against the targets."""
    runs = [dict(r, _source=name) for name, rows in sources for r in load(name)["runs"]
            if r.get("row") in rows and "error" not in r]
    model = {"flux": "Flux-dev 12B", "qwen": "Qwen2.5-7B shape"}
    runs.sort(key=lambda r: (list(START_TIME_TARGETS).index(r["row"]), ["serial", "cold", "warm"].index(r["mode"])))

    def weights(r: dict) -> str:
        return "int8, checkpoint + slab on disk" if ":files" in r["row"] else "int8, built in memory"

    def run(r: dict) -> str:
        return {"serial": "cold, ahead workers off (`STAGEHAND_AHEAD_WORKERS=0`)",
                "cold": "cold (default: two ahead workers)", "warm": "warm"}[r["mode"]]

    def timed(r: dict) -> float:
        what = START_TIME_TARGETS[r["row"]][0]
        return r["first_step_s"] + (r["offload_s"] if what.startswith("offload") else 0.0)

    def target(r: dict) -> str:
        what, cold, warm = START_TIME_TARGETS[r["row"]]
        limit = warm if r["mode"] == "warm" else cold
        return f"{what} <= {limit} s: {'met' if timed(r) <= limit else 'not met'}"

    cols = [Col("model", lambda r: model[r["row"].split(":")[0]]), Col("weights", weights), Col("run", run),
            Col("offload s", field("offload_s", num, 1)), Col("first step s", field("first_step_s", num, 1)),
            Col("offload + first step s", lambda r: num(r["offload_s"] + r["first_step_s"], 1)),
            Col("target", target), Col("steps 2-4 ms", lambda r: " / ".join(ms(v) for v in r["step_ms"][:3])),
            Col("steady ms", field("steady_ms", ms)), Col("source", lambda r: f"`{r['_source']}`")]
    what = ("The call every example makes: `offload(model, precision=\"int8\", vram_budget=...)` then "
            "`torch.compile(model, backend=\"stagehand\")`, default settings (`benches/start_time.py --rows <row> "
            "--modes serial cold warm --bytecode-cache`, the checkpoint + slab rows with `--drop-page-cache`), "
            "LoRA r=16, AdamW, `vram_budget` Flux 16 GiB, Qwen-7B 20 GiB; each run a fresh process; cold: every cache "
            "empty; warm: a second process on the same machine; steady: the median of the last three steps. The "
            "serial rows (and the two first files) ran before two ahead workers became the default; the cold rows "
            "ran with two workers: `start_time_default_a2094c3.json` and `start_time_default_ca3693e.json` at the "
            "default, the others with `--ahead-workers 2`")
    return f"{caption(*[n for n, _ in sources], what=what)}\n\n{table(runs, cols)}\n"


# ---- mixture-of-experts, several GPUs, the capture, the host optimizer --------------------------------------------


def moe_table(name: str = "moe_qwen3_30b.json") -> str:
    """The MoE LoRA step with streamed experts against its limits (benches/moe.py)."""
    data = load(name)
    rows = [r for r in data["rows"] if "error" not in r]
    cols = [Col("run", lambda r: r["mode"]), Col("step ms", field("step_ms", ms)),
            Col("H2D GB / step", field("h2d_gb_step", num, 1)),
            Col("the plan's H2D GB / step", field("planned_h2d_gb_step", num, 1)),
            Col("H2D limit ms (the plan's bytes)", field("planned_h2d_limit_ms", ms)),
            Col("H2D ms of the measured traffic", field("h2d_limit_ms", ms)),
            Col("compute limit ms", field("compute_limit_ms", ms)),
            Col("step / larger limit", field("vs_limit", num, 2)),
            Col("x experts dense", field("vs_dense_experts", num, 3)), Col("peak GiB", field("peak_gib", num, 1)),
            Col("first step s", field("first_step_s", num, 1)),
            Col("sync fetches / step", field("sync_fetches_step", num, 0))]
    what = (f"transformers' Qwen3MoeForCausalLM at Qwen3-30B-A3B's shape ({data['params_b']}B parameters: 48 layers, "
            f"128 experts, top-8), LoRA r=16 on attention, AdamW, checkpointing, T={data['sequence']}; the resident "
            "row is the plain model on the GPU with each layer compiled by torch.compile (the compute limit); the "
            f"H2D limit is the weight bytes the row's plan must copy up a step (each streamed block's fetches, the "
            f"slots' reuse counted) at the pinned bandwidth measured in the run ({data['pinned_h2d_gbps']} GB/s), "
            "with the time of the traffic the run measured beside it (a run that recorded no plan bytes shows that "
            "alone, and its \"step / larger limit\" is to it); `stagehand.compile_blocks`, `vram_budget` per row; int8 stacks are "
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


def _spread(stat: dict | None) -> str:
    """mean +- sample std over seeds (the mean alone for one seed)."""
    if not stat or stat.get("mean") is None:
        return ""
    return f"{stat['mean']:.3f}" + (f" +- {stat['std']:.3f}" if stat.get("std") is not None else "")


QUALITY_RUNS = ("quality_h200.json", "quality_h200_full_selective.json")  # the second: an arm the first lacks


def quality(names=QUALITY_RUNS) -> str:
    """Held-out retrieval of the pretrained MiniLM after contrastive fine-tuning, per base and method, and the
    targets' verdicts (benches/quality.py); a later file adds the arms an earlier one could not run (each arm's
    targets are against the bf16 arm of its own file)."""
    files = [load(n) for n in names]
    arms, targets, skipped, have = [], [], [], set()
    for data in files:  # an arm an earlier file has is left out of a later one
        arms += [r for r in data["arms"] if (r["arm"], r["method"]) not in have]
        targets += [t for t in data["targets"] if (t["arm"], t["method"]) not in have]
        skipped += data.get("skipped") or []
        have |= {(r["arm"], r["method"]) for r in data["arms"]}
    skipped = [k for k in skipped if (k["arm"], k["method"]) not in have]
    s = files[0]["settings"]
    cols = [Col("method", lambda r: r["method"]), Col("base", lambda r: r["arm"]),
            Col("seeds", lambda r: str(len(r["seeds"]))),
            Col("R@1 before", lambda r: _spread(r["before_recall_at_1"])),
            Col("R@1 after", lambda r: _spread(r["after_recall_at_1"])),
            Col("MRR before", lambda r: _spread(r["before_mrr"])), Col("MRR after", lambda r: _spread(r["after_mrr"])),
            Col("MB streamed a step", field("h2d_mb_per_step", num, 1)), Col("x bf16's bytes", field("bytes_vs_bf16")),
            Col("step ms", field("step_ms", ms))]
    incomplete = [f"{n} ran {len(d['runs'])} of its {d['runs_planned']} runs"
                  for n, d in zip(names, files) if not d["complete"]]
    what = (f"{files[0]['model']['name']} (pretrained, from the wheel {files[0]['model']['package']}), "
            f"{s['steps']} steps of {s['batch']} (docstring, source) pairs at {s['seq']} tokens, {s['eval_pairs']} "
            f"held-out pairs; LoRA r={s['lora_r']} lr {s['lr_lora']}, full fine-tuning lr {s['lr_full']} "
            f"({s['full_optimizer']}); inner compiler {s['inner']}; mean +- sample std over seeds"
            + "".join(f"; {x}" for x in incomplete)
            + "; an arm from a later file is judged against that file's own bf16 arm (not shown)" * (len(files) > 1))
    target_cols = [Col("target", lambda r: r["target"]), Col("value", field("value", num, 4)),
                   Col("bf16", field("bf16", num, 4)), Col("delta", field("delta", num, 4)),
                   Col("bf16 spread", field("spread", num, 4)), Col("verdict", lambda r: r["verdict"]),
                   Col("the layers of largest int8 error", lambda r: ", ".join(
                       x.removeprefix("encoder.layer.") for x in r.get("explained_by") or []))]
    not_run = "".join(f"\n\nNot run: {k['method']} {k['arm']} seed {k['seed']}: {k['reason']}." for k in skipped)
    return (f"{caption(*names, what=what)}\n\n{table(arms, cols)}\n\nTargets (mean after training >= bf16's mean "
            f"- bf16's seed spread):\n\n{table(targets, target_cols)}{not_run}\n")


def quality_int8_error(name: str = "quality_h200.json") -> str:
    """The streamed Linears' INT8 error on the real checkpoint beside a random init of the same config."""
    data = load(name)["int8_error"]
    real = {r["layer"]: r for r in data["real"]["layers"]}
    random_init = {r["layer"]: r for r in data["random_init"]["layers"]}
    worst = sorted(real.values(), key=lambda r: -r["int8_rel_err"])[:8]
    rows = [dict(r, random=random_init.get(r["layer"], {})) for r in worst]
    cols = [Col("layer", lambda r: r["layer"].removeprefix("encoder.layer.")),
            Col("shape", lambda r: f"{r['out']}x{r['inp']}"),
            Col("int8 rel err (real)", field("int8_rel_err", num, 4)),
            Col("int8 rel err (random init)", lambda r: num(r["random"].get("int8_rel_err"), 4)),
            Col("worst row (real)", field("int8_worst_row_rel_err", num, 4)),
            Col("fp8 rel err (real)", field("fp8_rel_err", num, 4)),
            Col("absmax / rms (real)", field("absmax_over_rms", num, 1)),
            Col("absmax / rms (random init)", lambda r: num(r["random"].get("absmax_over_rms"), 1))]
    summary = [dict(weights=w, **data[key]["summary"]) for w, key in (("real checkpoint", "real"),
                                                                      ("random init", "random_init"))]
    sums = [Col("weights", lambda r: r["weights"]),
            Col("int8 rel err mean / max", lambda r: f"{r['int8_rel_err']['mean']:.4f} / {r['int8_rel_err']['max']:.4f}"),
            Col("fp8 rel err mean", lambda r: f"{r['fp8_rel_err']['mean']:.4f}"),
            Col("absmax / rms mean / max",
                lambda r: f"{r['absmax_over_rms']['mean']:.1f} / {r['absmax_over_rms']['max']:.1f}")]
    what = (f"||Q(W) - W|| / ||W|| per streamed Linear (quantizer {data['quantizer']}, weights {data['weights']}), "
            "the eight worst of the real checkpoint")
    return (f"{caption(name, what=what)}\n\n{table(rows, cols)}\n\nOver the {len(real)} streamed Linears:\n\n"
            f"{table(summary, sums)}\n")


# ---- GPU test logs -------------------------------------------------------------------------------------------------


def labelled_test_logs() -> tuple[str, ...]:
    """The GPU test logs under benches/results/ that name their commit and a clean tree: the ones quoted."""
    return tuple(p.name for p in sorted(RESULTS.glob("*tests*.log")) if unrecorded(p.name) is None)


def gpu_test_logs() -> str:
    """Each labelled GPU test log: the header benches/device_run.sh wrote and the run's own summary lines."""
    rows = []
    for name in labelled_test_logs():
        lines = (RESULTS / name).read_text(errors="replace").splitlines()
        header = [l.lstrip("# ").strip() for l in lines if LOG_HEADER.match(l)]
        summary = [l[2:].strip() for l in lines if l.startswith(("# summary of this run:", "# pytest exit"))]
        rows.append({"log": f"`{REL}/{name}`", "header": "; ".join(header),
                     "summary": "<br>".join(summary) or "no pytest summary line"})
    cols = [Col("log", lambda r: r["log"]), Col("commit, device and date it records", lambda r: r["header"]),
            Col("pytest summary lines, as written", lambda r: r["summary"])]
    return ("Every GPU test log under `benches/results/` that opens with benches/device_run.sh's header (its commit "
            f"and a clean tree), quoted.\n\n{table(rows, cols)}\n")


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


# ---- full fine-tuning, long runs ------------------------------------------------------------------------------------


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


EQUAL_WORK_RUNS = ("full_finetune_qwen14_one_run_stagehand.json", "full_finetune_qwen14_one_run_deepspeed.json")


def full_finetune_equal() -> str:
    """stagehand against DeepSpeed ZeRO-Offload doing the same job: every parameter with an fp32 master and fp32
    moments on both sides; each row's recompute and, for stagehand, where the resident parameters' states live."""
    rows = [dict(r, commit=env_of(load(name)).get("commit", "")[:7]) for name in EQUAL_WORK_RUNS
            for r in load(name)["rows"]]
    fastest = min(r["step_ms"] for r in rows if r.get("step_ms") and r["mode"].startswith("DeepSpeed"))
    cols = [Col("mode", lambda r: r.get("mode", "")), Col("commit", lambda r: r["commit"]),
            Col("activation recompute", lambda r: r.get("recompute", "")),
            Col("resident parameters' states", lambda r: r.get("resident_states") or
                ("host (with every parameter's)" if r["mode"].startswith("DeepSpeed") else "")),
            Col("step ms", field("step_ms", ms)),
            Col("x the fastest DeepSpeed row", lambda r: num(r["step_ms"] / fastest) if r.get("step_ms") else ""),
            Col("GPU peak GiB", field("peak_gib")), Col("host peak RSS GB", field("peak_rss_gb", num, 1)),
            Col("H2D limit ms", field("limit_h2d_ms", ms)), Col("D2H limit ms", field("limit_d2h_ms", ms)),
            Col("streamed blocks' host optimizer ms", field("limit_host_optimizer_ms", ms)),
            Col("blocks updated on the GPU", lambda r: str(len(r["device_blocks"])) if "device_blocks" in r else ""),
            Col("", lambda r: r.get("error", ""))]
    data = load(EQUAL_WORK_RUNS[0])
    ds = next(r for r in rows if r.get("deepspeed"))
    zero = ds["deepspeed_config"]["zero_optimization"]
    settings = ", ".join(f"{k} {v}" for k, v in zero.items() if k not in ("stage", "offload_optimizer"))
    what = (f"Qwen2.5-7B's width, {data['layers']} of its 28 layers, sequence 2048, every parameter trained, AdamW "
            f"(lr {data['lr']}), bf16 weights, an fp32 master and fp32 moments of every parameter on both sides; "
            f"one process per row, every row on one machine in one session; median of {data['steps']} steps. DeepSpeed "
            f"{ds['deepspeed']}, ZeRO-2, offload_optimizer cpu with pin_memory, {settings}; "
            f"its CPU Adam on {ds['binding']['cores']} threads (every core)")
    return f"{caption(*EQUAL_WORK_RUNS, what=what)}\n\n{table(rows, cols)}\n"


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


# ---- the registry --------------------------------------------------------------------------------------------------


@dataclass
class Figure:
    make: Callable[[], str]
    # The files it reads: names under benches/results/ (a name may be a glob), or paths of code (with a folder);
    # a function when the files are found when the figure is made (the labelled test logs).
    sources: tuple[str, ...] | Callable[[], tuple[str, ...]]
    normalise: Callable[[str], str] = lambda text: text

    def files(self) -> tuple[str, ...]:
        return self.sources() if callable(self.sources) else self.sources

    def result_files(self) -> list[str]:
        """The files under benches/results/ it reads, globs expanded (a source with a folder is code)."""
        out = []
        for source in self.files():
            if "/" not in source:
                out += [p.name for p in sorted(RESULTS.glob(source))] if "*" in source else [source]
        return out


FIGURES: dict[str, Figure] = {
    "headline": Figure(headline, HEADLINE_SWEEPS),
    "sweep_flux": Figure(lambda: sweep("budget_sweep_flux.json"), ("budget_sweep_flux.json",)),
    "sweep_qwen": Figure(lambda: sweep("budget_sweep_qwen.json"), ("budget_sweep_qwen.json",)),
    "start_time": Figure(start_time_table, ("start_time_mixed.json",)),
    "start_time_default": Figure(start_time_default_table, tuple(name for name, _ in START_TIME_DEFAULT)),
    "start_time_blocks": Figure(start_time_blocks_table, tuple(name for name, _ in START_TIME_SOURCES)),
    "start_time_latest": Figure(start_time_latest_table, tuple(n for n, _, _ in START_TIME_LATEST)),
    "capture_split": Figure(capture_split_table, ("capture_split_cpu.json",)),
    "moe": Figure(moe_table, ("moe_qwen3_30b.json",)),
    "moe_planned": Figure(lambda: moe_table("moe_qwen3_30b_planned.json"), ("moe_qwen3_30b_planned.json",)),
    "moe_generate": Figure(moe_generate_table, ("moe_generate.json",)),
    "multi_gpu_flux": Figure(lambda: multi_gpu_table("multi_gpu_flux.json"), ("multi_gpu_flux.json",)),
    "host_adamw_states": Figure(host_adamw_states, ("host_adamw_states_cpu.json",)),
    "quality": Figure(quality, QUALITY_RUNS),
    "quality_int8_error": Figure(quality_int8_error, ("quality_h200.json",)),
    "gpu_test_logs": Figure(gpu_test_logs, labelled_test_logs),
    "offload_report": Figure(offload_report, ("examples/quickstart.py (run on the CPU)",), normalise_seconds),
    "demo_shapes": Figure(demo_shapes, ("stagehand/app/demo.py",)),
    "full_finetune_qwen_deepspeed": Figure(lambda: full_finetune("full_finetune_qwen_deepspeed.json"),
                                           ("full_finetune_qwen_deepspeed.json",)),
    "soak": Figure(soak, ("soak_qwen7b.json",)),
    "soak_gc_walks": Figure(lambda: soak("soak_qwen7b_gc_walks.json"), ("soak_qwen7b_gc_walks.json",)),
    "soak_oom": Figure(soak_oom, ("soak_oom.json",)),
    "soak_restore": Figure(lambda: soak("soak_qwen7b_restore.json"), ("soak_qwen7b_restore.json",)),
    "full_finetune_equal": Figure(full_finetune_equal, EQUAL_WORK_RUNS),
    "flux_peers": Figure(flux_peers, FLUX_PEER_RUNS),
    **{f"full_finetune_{run}": Figure(lambda run=run: full_finetune(f"full_finetune_{run}.json"),
                                      (f"full_finetune_{run}.json",))
       for run in ("flux", "flux_int8_states")},
}


# ---- documents: find, check, write ---------------------------------------------------------------------------------


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


@dataclass
class Problem:
    doc: str
    block: str  # the figure's name, or "" for a cited path or a figure in prose
    what: str
    line: int = 0  # where in the document, for a figure in prose

    def __str__(self) -> str:
        where = f"{self.doc}:{self.line}" if self.line else self.doc
        return f"{where}: " + (f"block figures:{self.block}: " if self.block else "") + self.what


class Renderer:
    """Each figure made once per run of the check (a document may quote one figure twice), and each result file's
    record of its commit read once."""

    def __init__(self):
        self.made: dict[str, str] = {}
        self.why_unrecorded: dict[str, str | None] = {}

    def __call__(self, name: str) -> str:
        if name not in self.made:
            self.made[name] = FIGURES[name].make()
        return self.made[name]

    def unrecorded(self, source: str) -> str | None:
        if source not in self.why_unrecorded:
            self.why_unrecorded[source] = unrecorded(source)
        return self.why_unrecorded[source]


# A figure typed into prose: a number, or a range of two (16-18), followed by a unit of
#   time      ns us µs ms s sec second(s) min minute(s) h hour(s) day(s)
#   size      KB kB KiB MB MiB GB GiB TB TiB PB, each also per second (GB/s)
#   rate      GFLOP/s TFLOP/s GFLOPS TFLOPS, tokens/s samples/s steps/s it/s
#   share     %
#   ratio     x or × right after the number (1.9x, 0.53×)
# A number that ends a name (bf16s, sm_90, Qwen2.5-7B, a commit) is not one: it may not follow a letter, a digit,
# an underscore or a point. Byte counts per parameter ("12 bytes a parameter") are formats, not runs: no unit here.
PROSE_FIGURE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?"
    r"(?:\s?(?:[nuµm]?s|sec|seconds?|min|minutes?|h|hours?|days?|[kKMGTP]i?B(?:/s)?"
    r"|[GT]FLOP/s|[GT]FLOPS|(?:tokens|samples|steps|it)/s)(?![\w/])"
    r"|\s?%|[x×](?!\w))")
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1)(?!\n[ \t]*\n).)+?\1", re.S)  # inline code, within a paragraph


def prose_of(text: str) -> str:
    """The text a person typed: generated blocks, fenced code and inline code blanked, each line kept in place."""
    for pattern in (BLOCK, FENCE, CODE_SPAN):
        text = pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return text


def prose_figures(doc: str, text: str) -> list[Problem]:
    """A problem for every figure in the prose of one document, with its line."""
    prose = prose_of(text)
    return [Problem(doc, "", f"{m.group(0)!r} stands in the prose: quote it from a generated block "
                             "(python benches/figures.py --list), or drop it", line=prose.count("\n", 0, m.start()) + 1)
            for m in PROSE_FIGURE.finditer(prose)]


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
    """What is wrong in one document: blocks that differ from their files or read a run that names no commit and
    clean tree, bad blocks, cited files missing, figures in prose."""
    problems = _structure_problems(doc, text)
    for m in BLOCK.finditer(text):
        name, body = m.group("name"), m.group("body")
        if name not in FIGURES:
            problems.append(Problem(doc, name, f"no such figure (known: {', '.join(FIGURES)})"))
            continue
        for source in FIGURES[name].result_files():
            why = (RESULTS / source).exists() and render.unrecorded(source)
            if why:
                problems.append(Problem(doc, name, f"reads {REL}/{source}, which {why}: quote only runs that record "
                                                   "their commit and a clean tree (run it again, or remove the block)"))
        try:
            want = render(name)
        except Exception as e:  # noqa: BLE001 - a file that is gone or changed shape: say which block needs it
            problems.append(Problem(doc, name, f"cannot be made from {', '.join(FIGURES[name].files())}: "
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
    return problems + prose_figures(doc, text)


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
            print(f"{name:28s} {', '.join(fig.files())}")
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
