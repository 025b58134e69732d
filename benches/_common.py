"""Shared bench helpers: an environment header, tabulate tables, JSON results, resident baselines.

    from _common import env_info, print_header, print_table, write_json
    print_header()                       # device, torch, triton, python, commit and tree state
    print_table(rows, headers, title="forward")
    write_json(args.out, {"env": env_info(), "rows": rows})

Every bench that reports a ratio to the resident model takes it the same way:
`resident_row("inductor" | "eager", ...)` measures the plain model under
torch.compile's defaults or eagerly (labelled "resident (inductor)" /
"resident (eager)"), `add_ratios` gives a row `ratio_inductor` (first) and
`ratio_eager`, `first_step` and `Sync.peaks` give the first step's and the
timed steps' peaks, allocated and reserved.

Benches run as scripts (`python benches/x.py`), so they import this module by
its bare name; the folder is put on sys.path by the script being run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import signal
import subprocess
import threading
import time
import traceback
from datetime import datetime, timezone

import torch
from tabulate import tabulate

from torch_stagehand.runtime.atomic_file import write_atomic

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def env_info() -> dict:
    """Device name and library versions, for every table and JSON file."""
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cpu",
        "time_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **source_state(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - a bench without Triton still reports
        info["triton"] = None
    for lib in ("transformers", "diffusers", "peft"):  # the model libraries decide what the graph holds
        try:
            info[lib] = __import__(lib).__version__
        except Exception:  # noqa: BLE001 - a bench that builds no such model still reports
            info[lib] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            sm_count=p.multi_processor_count,
            gpu_mem_gib=round(p.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            capability=f"{p.major}.{p.minor}",
        )
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["cpu_threads"] = torch.get_num_threads()
    return info


def source_state() -> dict:
    """The commit this run's code is, and whether the tree was clean: COMMIT / DIRTY from the environment (the
    device copy has no .git; benches/device_run.sh's caller passes them), else read-only git here, else unknown.

    DIRTY is the number of changed or untracked files (`git status --porcelain | wc -l`): 0 is a clean tree."""
    commit, dirty = os.environ.get("COMMIT", "").strip(), os.environ.get("DIRTY", "").strip()
    if not commit:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        try:
            top = subprocess.run(["git", "-C", repo, "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout.strip()
            if os.path.realpath(top) != os.path.realpath(repo):  # a copy inside another checkout: not its commit
                raise subprocess.SubprocessError(f"{repo} is not the root of the checkout at {top}")
            commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                                    timeout=10, check=True).stdout.strip()
            dirty = str(len(subprocess.run(["git", "-C", repo, "status", "--porcelain"], capture_output=True,
                                           text=True, timeout=30, check=True).stdout.splitlines()))
        except (OSError, subprocess.SubprocessError):
            commit = ""
    tree = "unknown" if dirty == "" else ("clean" if dirty in ("0", "clean") else f"dirty ({dirty})")
    return {"commit": commit or "unknown", "tree": tree}


# Column headers for the row fields every bench shares: the ratio to the compiled resident model comes first.
HEADERS = {
    "ratio_inductor": "x resident (inductor)", "ratio_eager": "x resident (eager)",
    "ratio_inductor_ckpt": "x resident ckpt (inductor)", "ratio_eager_ckpt": "x resident ckpt (eager)",
    "peak_gib": "peak alloc GiB", "peak_reserved_gib": "peak reserved GiB", "first_step_s": "first step s",
    "first_step_peak_gib": "first step alloc GiB", "first_step_peak_reserved_gib": "first step reserved GiB",
}


def print_rows(rows: list[dict], cols: list[str], title: str | None = None, keep_empty: bool = False) -> str:
    """Print dict rows with these columns (HEADERS names the shared ones); a column no row has is left out
    unless `keep_empty`."""
    if not keep_empty:
        cols = [c for c in cols if any(r.get(c) not in (None, "") for r in rows)]
    return print_table([[r.get(c, "") for c in cols] for r in rows], headers=[HEADERS.get(c, c) for c in cols],
                       title=title)


def print_header(info: dict | None = None) -> dict:
    info = info or env_info()
    print(" | ".join(f"{k}={v}" for k, v in info.items() if k != "time_utc"), flush=True)
    return info


def print_table(rows: list[dict] | list[list], headers="keys", title: str | None = None, floatfmt=".3g") -> str:
    """Print rows (dicts or lists) as a GitHub-style table; returns the text."""
    text = tabulate(rows, headers=headers, tablefmt="github", floatfmt=floatfmt)
    if title:
        print(f"\n## {title}")
    print(text, flush=True)
    return text


def write_json(path: str, payload: dict) -> str:
    """Write payload (plus nothing else) as indented JSON, creating the folder."""
    # through a temporary file and a rename: a bench killed mid-write leaves the old results, not half of them
    write_atomic(os.path.abspath(path), json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def proc_status() -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile of this process, bytes (Linux's /proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def host_memory() -> dict:
    """This process's host memory now: RSS, its peak (VmHWM), and what PyTorch's pinned allocator holds.

    The pinned figure is the caching host allocator's (`pin_memory=True` tensors, rounded up to powers of
    two); memory a tool locks itself (cudaHostRegister) is not in it."""
    import torch

    status = proc_status()
    out = {"rss_gb": round(status.get("VmRSS", 0) / 1e9, 2), "peak_rss_gb": round(status.get("VmHWM", 0) / 1e9, 2)}
    if torch.cuda.is_available():
        out["torch_pinned_gb"] = round(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / 1e9, 2)
    return out


def reset_host_peak(free_pinned_cache: bool = True) -> bool:
    """Start a new host-memory window: VmHWM back to the current RSS (Linux >= 4.0; returns whether it was),
    and PyTorch's cached pinned blocks freed."""
    import torch

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        if free_pinned_cache and torch.cuda.is_available() and hasattr(torch._C, name):
            getattr(torch._C, name)()
            break
    return reset


def host_us_per_call(fn, calls: int = 200) -> float:
    """Wall-clock us per call of `calls` back-to-back calls, synchronised at both ends.

    For ops far shorter on the GPU than on the host, this is the launch rate the
    host sustains (one warm-up call first)."""
    import time

    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


class CollectorClock:
    """Seconds Python's cyclic garbage collector ran, and its runs, per generation, since this clock was made
    (gc.callbacks): a collection of a large heap (Dynamo's and Inductor's objects) is a suspect for a slow step."""

    def __init__(self):
        self.seconds, self.counts, self._t0 = [0.0, 0.0, 0.0], [0, 0, 0], 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t0
            self.counts[info["generation"]] += 1

    def read(self) -> dict:
        return {"s": [round(x, 3) for x in self.seconds], "collections": list(self.counts)}


class Sync:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def fresh(self):
        """Before a row's first step: what earlier rows left in the caching allocator goes back to the driver,
        so the row's reserved peak is its own."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def peak_gib(self) -> float | None:
        return round(torch.cuda.max_memory_allocated() / 2**30, 2) if self.cuda else None

    def peak_reserved_gib(self) -> float | None:
        return round(torch.cuda.max_memory_reserved() / 2**30, 2) if self.cuda else None

    def peaks(self, prefix: str = "") -> dict:
        """max_memory_allocated and max_memory_reserved since the last reset, GiB."""
        return {f"{prefix}peak_gib": self.peak_gib(), f"{prefix}peak_reserved_gib": self.peak_reserved_gib()}


def first_step(step, sync: Sync) -> dict:
    """A program's (or a plan's) first step on its own: its seconds (compiles included) and its peaks, counted
    from a reset just before it."""
    sync.fresh()
    sync.reset_peak()
    t0 = time.perf_counter()
    step()
    sync()
    return {"first_step_s": round(time.perf_counter() - t0, 1), **sync.peaks("first_step_")}


# Resident baselines: the plain model on the device, every weight resident, run eagerly and under
# torch.compile's default backend (Inductor). Every ratio is a row's step time over a baseline's, taken in
# the same run and at the same checkpointing; the compiled one is the baseline that counts and comes first.
BASELINES = ("inductor", "eager")
RATIO_COLUMNS = [f"ratio_{compiler}" for compiler in BASELINES]
PEAK_COLUMNS = ["peak_gib", "peak_reserved_gib", "first_step_s", "first_step_peak_gib", "first_step_peak_reserved_gib"]
RATIOS_NOTE = {  # what a row's ratio fields mean, for the JSON
    "ratio_inductor": "step_ms / step_ms of 'resident (inductor)': the plain model under torch.compile's default "
                      "backend and options, every weight on the device, same run, same checkpointing",
    "ratio_eager": "step_ms / step_ms of 'resident (eager)': the plain model run eagerly, same run and checkpointing",
    "ratio": "old field, kept for readers of earlier files: the same as ratio_eager",
    "peaks": "peak_gib / peak_reserved_gib: torch.cuda.max_memory_allocated / max_memory_reserved over the timed "
             "steps; first_step_*: over the row's first step alone (the allocator's cache emptied before it)",
}


def resident_label(compiler: str, what: str = "resident") -> str:
    return f"{what} ({compiler})"


def add_ratios(row: dict, baselines: dict, suffix: str = "") -> dict:
    """ratio_inductor{suffix}, then ratio_eager{suffix}: the row's step_ms over each baseline row's."""
    for compiler in BASELINES:
        base = baselines.get(compiler) or {}
        if base.get("step_ms") and row.get("step_ms"):
            row[f"ratio_{compiler}{suffix}"] = round(row["step_ms"] / base["step_ms"], 3)
    return row


class TimeLimit(BaseException):
    """A row ran past its --inductor-limit-s (a BaseException: Dynamo and Inductor turn Exceptions into their
    own errors or fallbacks, and this must reach the bench)."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Interrupt the main thread after `seconds` (0: no limit) with TimeLimit."""
    if not seconds or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise TimeLimit(f"{what}: stopped after the {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _compile_blocks(model) -> list:
    """Regional compilation (diffusers' `compile_repeated_blocks`, accelerate's regional compile): every
    repeated block compiled in place with torch.compile's defaults, one program per block structure. The
    blocks; `_uncompile` puts them back."""
    from torch_stagehand.runtime.blocks import find_blocks

    blocks = [model.get_submodule(fqn) for fqn in find_blocks(model)]
    for block in blocks:
        block.compile()
    return blocks


def _uncompile(blocks: list) -> None:
    for block in blocks:
        block._compiled_call_impl = None


def resident_row(compiler: str, model, step_of, run, label: str | None = None, limit_s: float = 0,
                 also=None, regional: bool = False) -> dict:
    """One baseline row: `run(label, step)` on `step_of(model)` ("eager") or on `step_of(torch.compile(model))`
    ("inductor": the default backend with its default options, the same step function; `regional`: each
    repeated block compiled instead of the whole model, for a model whose whole-graph compile takes minutes).
    The inductor row's first step is its compile: `compile_s` is that step less a measured one. `limit_s`
    bounds the row; `also(label, step)` runs after a measured row, while the compiled program is there."""
    label = label or resident_label(compiler)
    fn, compiled_blocks = model, []
    if compiler == "inductor":
        torch._dynamo.reset()
        if regional:
            compiled_blocks = _compile_blocks(model)
        else:
            fn = torch.compile(model)
    try:
        with time_limit(limit_s if compiler == "inductor" else 0, label):
            row = run(label, step_of(fn))
        if also is not None:
            also(label, step_of(fn))
    except torch.OutOfMemoryError:
        row = {"mode": label, "error": "out of GPU memory"}
    except TimeLimit as e:
        row = {"mode": label, "error": str(e)}
    except Exception as e:  # noqa: BLE001 - a baseline that fails (a compile error) is recorded; the bench goes on
        traceback.print_exc()
        row = {"mode": label, "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
    finally:
        if compiler == "inductor":
            del fn
            _uncompile(compiled_blocks)
            torch._dynamo.reset()
        gc.collect()
    row["baseline"] = compiler
    if regional and compiler == "inductor":
        row["compiled"] = "regional: each repeated block (torch.compile defaults)"
    if compiler == "inductor" and row.get("first_step_s") is not None and row.get("step_ms"):
        row["compile_s"] = round(row["first_step_s"] - row["step_ms"] / 1e3, 1)
        print(f"  {label}: first step {row['first_step_s']} s, of which compiling ~{row['compile_s']} s", flush=True)
    elif "error" in row:
        print(f"  {label}: {row['error']}", flush=True)
    return row


def inductor_settings() -> dict:
    """Inductor's settings that decide what the baseline's code is, as this run had them (torch's defaults:
    the benches change none), and how full its on-disk cache was at the start (a warm cache shortens the
    compile, not the step)."""
    from torch._inductor import config

    out = {k: getattr(config, k, None) for k in ("max_autotune", "max_autotune_gemm", "coordinate_descent_tuning",
                                                  "epilogue_fusion", "freezing", "fx_graph_cache",
                                                  "autotune_local_cache", "compile_threads")}
    out["triton.cudagraphs"] = config.triton.cudagraphs
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        root = cache_dir()
        out["cache_dir"] = root
        out["fx_graph_cache_entries_at_start"] = len(os.listdir(os.path.join(root, "fxgraph"))) \
            if os.path.isdir(os.path.join(root, "fxgraph")) else 0
    except Exception:  # noqa: BLE001 - an older or newer layout: the settings still report
        out["cache_dir"] = None
    return out
