"""Shared bench helpers: an environment header, tabulate tables, JSON results.

    from _common import env_info, print_header, print_table, write_json
    print_header()                       # device, torch, triton, python
    print_table(rows, headers, title="forward")
    write_json(args.out, {"env": env_info(), "rows": rows})

Benches run as scripts (`python benches/x.py`), so they import this module by
its bare name; the folder is put on sys.path by the script being run.
"""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone

from tabulate import tabulate

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def env_info() -> dict:
    """Device name and library versions, for every table and JSON file."""
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cpu",
        "time_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
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
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")
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

