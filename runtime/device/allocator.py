"""What the CUDA caching allocator says and how it is set: refusals counted, the room this process may hold, the
bytes its cache holds in pieces, expandable segments (process-wide: kept after `restore()`, as an env var would be)."""

from __future__ import annotations

import time

import torch
from torch_stagehand.environment import env, is_set

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_ooms(device: torch.device) -> int:
    """How many allocations the CUDA caching allocator has refused in this process (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    # Read once a step: the nested form skips flattening the allocator's few hundred statistics.
    return int(torch.cuda.memory.memory_stats_as_nested_dict(device).get("num_ooms", 0))


def allocated_bytes(device: torch.device) -> int:
    """`torch.cuda.memory_allocated(device)` without flattening every statistic (read at every fetch); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory.memory_stats_as_nested_dict(device).get("allocated_bytes", {}).get("all", {})
               .get("current", 0))


def device_room(device: torch.device) -> int | None:
    """Bytes this process may hold on `device` now (free plus its reserved, within its memory fraction), or None."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()  # the getters want one
    free, total = torch.cuda.mem_get_info(index)
    room = free + torch.cuda.memory_reserved(index)
    return int(min(room, torch.cuda.get_per_process_memory_fraction(index) * total))


def fragmented_bytes(device: torch.device) -> int:
    """Reserved bytes no tensor uses: free pieces of segments that hold live tensors. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return max(0, torch.cuda.memory_reserved(device) - allocated_bytes(device))


def use_expandable_segments(device: torch.device) -> str:
    """Turn on the caching allocator's expandable segments for the segments it maps from now on (a cache of pieces
    too small for a large buffer fails a unit that fits), unless PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF
    configures the allocator: the user's settings stand. Returns what was done, for the log."""
    if device.type != "cuda":
        return "not CUDA"
    for var in ALLOC_CONF_VARS:
        if is_set(var):
            return f"{var}={env(var)} set by the user: left as it is"
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    return "expandable_segments:True (Config.expandable_segments)"


def reserve(device: torch.device, nbytes: int) -> tuple[int, float]:
    """Have the caching allocator hold `nbytes` (a plan's predicted peak) now, so the plan's first step finds it
    mapped: the shortfall allocated, then freed into the cache, never past the device's room (a refusal would
    count as an out of memory). Returns (bytes newly held, seconds); nothing off CUDA."""
    if device.type != "cuda":
        return 0, 0.0
    before = torch.cuda.memory_reserved(device)
    room = device_room(device)
    target = min(nbytes, room - (64 << 20)) if room is not None else nbytes
    start, held = time.perf_counter(), []
    while (short := target - torch.cuda.memory_reserved(device)) > 0 and len(held) < 16:
        held.append(torch.empty(short, dtype=torch.uint8, device=device))
    del held  # freed here: kept cached
    added = torch.cuda.memory_reserved(device) - before
    return (added, time.perf_counter() - start) if added > 0 else (0, 0.0)
