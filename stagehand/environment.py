"""Every environment variable torch-stagehand reads or sets, typed and checked in one place.

The settings of a run are `Config` (config.py) and the backend's options; the environment holds what must reach
a process before any of those exist (caches, compile workers, tuning) and what other tools' variables mean to
us. Every part reads a variable through `env(name)`: a bad value is a `ConfigError` naming the variable, an unset
one its default. `stagehand env` prints them. Values are read at each call, so `config.patch` (or a test's
`monkeypatch.setenv`) takes effect at once. The tunables below are the sizes the code works in.

This module imports nothing of the package: the kernels and the compiler read it too.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field (a Config field, or an environment variable)."""


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str  # "flag" (0 / 1), "int" (>= 0), "str", "choice"
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    # Another tool's variable: read as that tool reads it, never refused here (its value is the tool's business).
    foreign: bool = False


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("STAGEHAND_CACHE_DIR", "str", None,
             "where compile bundles, tuned kernel configs, cost models and calibrations live "
             "(unset: ~/.cache/torch_stagehand)"),
    Variable("STAGEHAND_COMPILE_CACHE", "flag", True, "0: no compile bundles kept between runs"),
    Variable("STAGEHAND_COST_CACHE", "flag", True, "0: no calibrated cost model kept between runs"),
    Variable("STAGEHAND_TUNE_CACHE", "flag", True, "0: the INT8 kernels' tuned configs not kept between runs"),
    Variable("STAGEHAND_AUTOTUNE", "flag", True, "0: the INT8 kernels take their first candidate config, untimed"),
    Variable("STAGEHAND_TUNE_EVERY", "flag", False, "1: tune every shape again, ignoring the kept configs"),
    Variable("STAGEHAND_TUNE_THREADS", "int", 8, "threads that compile the INT8 kernels' candidates"),
    Variable("STAGEHAND_INDUCTOR_AUTOTUNE", "choice", "pointwise",
             "which Inductor kernels keep several launch configs, timed at their first launch",
             ("0", "1", "all", "none", "pointwise", "reductions")),
    Variable("STAGEHAND_AHEAD_WORKERS", "int", None,
             "processes that compile foreseen block variants while the step runs (unset: 2 on CUDA, 0 on the CPU)"),
    Variable("STAGEHAND_AHEAD_THREADS", "int", 0, "each ahead worker's Triton compile threads (0: cores / workers)"),
    Variable("STAGEHAND_AHEAD_TUNING", "flag", True, "0: the ahead workers skip the INT8 kernels' candidates"),
    Variable("STAGEHAND_AHEAD_DEBUG", "flag", False, "1: the ahead workers' stderr and logs shown"),
    Variable("STAGEHAND_WARM_COMPILE_WORKERS", "flag", True, "0: Inductor's compile workers not started at offload"),
    Variable("STAGEHAND_NODE_NAME", "str", None, "the node the ranks of one host store share (unset: the host name)"),
    Variable("STAGEHAND_ALLOW_CUDNN_SDPA", "flag", False,
             "1: keep cuDNN's attention under block streaming (its gradients were measured wrong there)"),
    # other tools' variables that change what we do
    Variable("TRITON_INTERPRET", "flag", False, "Triton's interpreter: the kernels run on the CPU", foreign=True),
    Variable("TORCHINDUCTOR_COMPILE_THREADS", "int", None, "Inductor's compile threads: caps the ahead workers'",
             foreign=True),
    Variable("PYTORCH_CUDA_ALLOC_CONF", "str", None, "the user's allocator settings: expandable segments left alone",
             foreign=True),
    Variable("PYTORCH_ALLOC_CONF", "str", None, "the user's allocator settings: expandable segments left alone",
             foreign=True),
    Variable("ACCELERATE_DYNAMO_BACKEND", "str", None, "TrainingArguments' export for accelerate (trainers.py)",
             foreign=True),
)}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_TRITON_TRUE = ("1", "true", "yes", "on", "y")  # Triton's own reading of a flag (anything else is off)


def env(name: str) -> Any:
    """The typed value of `name` (one of VARIABLES), or its default when unset or empty."""
    var = VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return var.default
    value = raw.strip()
    if var.foreign:
        if var.kind == "flag":
            return value.lower() in _TRITON_TRUE
        if var.kind == "int":
            try:
                return int(value)
            except ValueError:
                return var.default  # the tool that owns it says what is wrong with it
        return value
    if var.kind == "flag":
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ConfigError(f"{name} must be 0 or 1 (or true / false, yes / no, on / off), got {raw!r}")
    if var.kind == "int":
        if not value.isdigit():
            raise ConfigError(f"{name} must be an int >= 0, got {raw!r}")
        return int(value)
    if var.kind == "choice" and value not in var.choices:
        raise ConfigError(f"{name} must be one of {sorted(var.choices)}, got {raw!r}")
    return value


def is_set(name: str) -> bool:
    """Whether the user set `name` (to anything but the empty string)."""
    VARIABLES[name]
    return bool(os.environ.get(name, "").strip())


def set_env(name: str, value: str | None) -> None:
    """Set (None: remove) one of VARIABLES in this process's environment, for the processes it starts."""
    VARIABLES[name]
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment with `overrides`, for a worker process."""
    return dict(os.environ, **overrides)


def cache_dir() -> str:
    """STAGEHAND_CACHE_DIR, else ~/.cache/torch_stagehand: the one root of every cache kept between runs."""
    return env("STAGEHAND_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_stagehand")


# The sizes the code works in (chunks, regrowth cadence): not a user's setting, but one a test shrinks to reach
# a path that only big inputs take. A module reads them through `tunable(name)` at each use; `patch` overrides them.
TUNABLES: dict[str, int] = {
    # elements a host AdamW call steps at once (train/host.py): one chunk's fp32 gradient, master, moments and
    # rounded weight stay in the cores' caches between the conversion, the kernel and the write-back
    "host_adamw_chunk": 1 << 21,
    "quantize_gpu_chunk": 64 << 20,      # elements quantized on the GPU per launch (kernels/quantize.py)
    "quantize_rows_per_chunk": 1024,     # rows quantized on the CPU per chunk (kernels/quantize.py)
    "oom_regrow_every": 50,              # steps between attempts to grow a plan OOM recovery shrank
    "weights_file_chunk": 8 << 20,       # bytes of one pread of a checkpoint (host/weights_file.py)
    "weights_file_merge_gap": 1 << 16,   # bytes of a gap two checkpoint reads merge over
    "slab_chunk_elements": 2 << 20,      # weight elements quantized at once while a slab is built (slab/builder.py)
}
_MAY_BE_ZERO = {"weights_file_merge_gap"}  # the others are sizes and periods
_tunable_overrides: dict[str, int] = {}


def tunable(name: str) -> int:
    """One of TUNABLES, or what `patch` set it to."""
    return _tunable_overrides.get(name, TUNABLES[name])


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[None]:
    """Override settings for the duration of a `with` block (or a decorated function), as Inductor's
    `config.patch`: a STAGEHAND_* (or other listed) variable by its name (None: unset), or one of TUNABLES.
    An unknown name is a ConfigError naming it."""
    unknown = sorted(k for k in changes if k not in VARIABLES and k not in TUNABLES)
    if unknown:
        raise ConfigError(f"config.patch: unknown setting(s) {unknown}; the variables are {sorted(VARIABLES)} and "
                          f"the tunables {sorted(TUNABLES)}")
    saved_env = {k: os.environ.get(k) for k in changes if k in VARIABLES}
    saved_sizes = {k: _tunable_overrides.get(k) for k in changes if k in TUNABLES}
    try:
        for k, v in changes.items():
            if k in VARIABLES:
                set_env(k, None if v is None else (("1" if v else "0") if isinstance(v, bool) else str(v)))
                env(k)  # a bad value fails here, naming the variable
            else:
                least = 0 if k in _MAY_BE_ZERO else 1
                if not isinstance(v, int) or isinstance(v, bool) or v < least:
                    raise ConfigError(f"config.patch: {k} must be an int >= {least}, got {v!r}")
                _tunable_overrides[k] = v
        yield
    finally:
        for k, v in saved_env.items():
            set_env(k, v)
        for k, v in saved_sizes.items():
            if v is None:
                _tunable_overrides.pop(k, None)
            else:
                _tunable_overrides[k] = v


def table() -> list[dict[str, Any]]:
    """The variables, their defaults, what this process has and what they do (`stagehand env` prints it)."""
    return [{"variable": v.name, "default": v.default, "set": os.environ.get(v.name), "what": v.doc}
            for v in VARIABLES.values()]
