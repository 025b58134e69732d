"""Process-wide settings that change what a variant traces or compiles to, though no torch cache key holds them. E.g.
AOTAutograd picks an attention backend as `torch.backends.cuda` allows: an ahead-compile worker with torch's defaults
could trace to cuDNN's attention, which `offload()` turns off, under the key the main process asks for. So every job
carries the main process's settings (`current`) and the worker adopts them (`adopt`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch_stagehand.environment import env, set_env

_SDPA_BACKENDS = ("flash", "mem_efficient", "math", "cudnn")

# STAGEHAND_INDUCTOR_AUTOTUNE: the Inductor kernels that keep several launch configs (inner.one_config_per_kernel)
AUTOTUNED = {"1": ("pointwise", "reductions"), "all": ("pointwise", "reductions"), "pointwise": ("pointwise",),
             "reductions": ("reductions",), "0": (), "none": ()}
AUTOTUNE_VARIABLE = "STAGEHAND_INDUCTOR_AUTOTUNE"


def autotune_choice() -> str:
    """`STAGEHAND_INDUCTOR_AUTOTUNE` (its default when unset), checked."""
    return env(AUTOTUNE_VARIABLE)


def _fp32_precision_holders() -> list[tuple[str, Any]]:
    holders = [("backends", torch.backends), ("matmul", torch.backends.cuda.matmul), ("cudnn", torch.backends.cudnn)]
    return [(name, module) for name, module in holders if hasattr(module, "fp32_precision")]


def current() -> dict[str, Any]:
    """This process's settings, as plain values (they travel in a pickle)."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    return {
        "sdpa": {name: bool(getattr(cuda, f"{name}_sdp_enabled")()) for name in _SDPA_BACKENDS},
        "cudnn": {"enabled": cudnn.enabled, "benchmark": cudnn.benchmark, "deterministic": cudnn.deterministic,
                  "allow_tf32": cudnn.allow_tf32},
        "matmul": {"allow_tf32": cuda.matmul.allow_tf32,
                   "allow_fp16_reduced_precision_reduction": cuda.matmul.allow_fp16_reduced_precision_reduction,
                   "allow_bf16_reduced_precision_reduction": cuda.matmul.allow_bf16_reduced_precision_reduction},
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        # torch >= 2.9's own TF32 switches (Inductor's key holds the matmul one), where this torch has them
        "fp32_precision": {name: getattr(module, "fp32_precision") for name, module in _fp32_precision_holders()},
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "inductor_autotune": autotune_choice(),
    }


def adopt(settings: dict[str, Any]) -> None:
    """Make this process's settings another's `current()`. Only those that differ are set: one of torch's older
    TF32 switches also sets its newer `fp32_precision` (part of Inductor's key)."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    now = current()
    with warnings.catch_warnings():  # torch's notes on its older TF32 switches: the values are what matter here
        warnings.simplefilter("ignore")
        for name, enabled in settings["sdpa"].items():
            if now["sdpa"][name] != enabled:
                getattr(cuda, f"enable_{name}_sdp")(enabled)
        for name, value in settings["cudnn"].items():
            if now["cudnn"][name] != value:
                setattr(cudnn, name, value)
        if now["float32_matmul_precision"] != settings["float32_matmul_precision"]:
            torch.set_float32_matmul_precision(settings["float32_matmul_precision"])
        for name, module in _fp32_precision_holders():
            if name in settings["fp32_precision"] and module.fp32_precision != settings["fp32_precision"][name]:
                module.fp32_precision = settings["fp32_precision"][name]
        now = current()  # the precisions set allow_tf32 too
        for name, value in settings["matmul"].items():
            if now["matmul"][name] != value:
                setattr(cuda.matmul, name, value)
        if now["deterministic"] != tuple(settings["deterministic"]):
            deterministic, warn_only = settings["deterministic"]
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    if now["inductor_autotune"] != settings["inductor_autotune"]:
        set_env(AUTOTUNE_VARIABLE, settings["inductor_autotune"])
