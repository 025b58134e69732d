"""What the machine can give the host store: available RAM, the cgroup's limit, the pinned cap.

`probe_machine()` reads the limits that decide whether an offload fits before
anything is allocated (`host_plan.preflight`):

* `/proc/meminfo` MemAvailable: what can be allocated without swapping;
* the cgroup (v2 `memory.max` / `memory.current`, v1 `memory.limit_in_bytes`
  / `memory.usage_in_bytes`) a container or `systemd-run -p MemoryMax=` puts
  the process in: past it the kernel OOM-kills with no traceback;
* the pinned cap: Windows (and WSL2, whose pinned pages are Windows' memory)
  page-locks at most about half of the physical RAM;
* RLIMIT_MEMLOCK, reported: the NVIDIA driver page-locks through its own path
  (cudaHostRegister and cudaHostAlloc are not bounded by it), so it applies
  only where `mlock` is what pins.

Tests replace `probe_machine` (monkeypatch) with a small fake machine.
"""

from __future__ import annotations

import os
import sys

try:
    import resource
except ImportError:  # Windows
    resource = None
from dataclasses import dataclass

_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MachineMemory:
    total_bytes: int
    available_bytes: int  # MemAvailable
    cgroup_limit_bytes: int | None = None  # None: no cgroup limit
    cgroup_used_bytes: int = 0
    pinned_cap_bytes: int | None = None  # None: no cap beyond RAM (Linux)
    memlock_limit_bytes: int | None = None  # RLIMIT_MEMLOCK soft limit; None: unlimited
    where: str = "linux"

    @property
    def usable_bytes(self) -> int:
        """What a new allocation can take: MemAvailable, and what is left under the cgroup's limit."""
        usable = self.available_bytes
        if self.cgroup_limit_bytes is not None:
            usable = min(usable, max(0, self.cgroup_limit_bytes - self.cgroup_used_bytes))
        return usable

    def describe(self) -> str:
        parts = [f"MemAvailable {gib(self.available_bytes)} of {gib(self.total_bytes)}"]
        if self.cgroup_limit_bytes is not None:
            parts.append(f"cgroup limit {gib(self.cgroup_limit_bytes)} ({gib(self.cgroup_used_bytes)} used)")
        if self.pinned_cap_bytes is not None:
            parts.append(f"{self.where} pinned cap {gib(self.pinned_cap_bytes)}")
        if self.memlock_limit_bytes is not None:
            parts.append(f"RLIMIT_MEMLOCK {gib(self.memlock_limit_bytes)} (not binding for CUDA pinning)")
        return ", ".join(parts)


def gib(n: int) -> str:
    """A byte count people read: GiB, or MiB / KiB below one."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size or unit == "KiB":
            return f"{n / size:.2f} {unit}"


def _meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields:
                    out[key] = int(fields[0]) * (1024 if len(fields) > 1 else 1)
    except OSError:
        pass
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    value = int(text)
    return None if value >= _UNLIMITED else value


def _cgroup() -> tuple[int | None, int]:
    """(limit, usage) of this process's memory cgroup; (None, 0) when there is none."""
    rel = ""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) == 3 and parts[0] == "0":
                    rel = parts[2]
    except OSError:
        pass
    for base in (os.path.join("/sys/fs/cgroup", rel.lstrip("/")), "/sys/fs/cgroup"):
        limit = _read_int(os.path.join(base, "memory.max"))
        if limit is not None:
            return limit, _read_int(os.path.join(base, "memory.current")) or 0
    limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit is not None:
        return limit, _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
    return None, 0


def _is_wsl() -> bool:
    try:
        with open("/proc/version") as f:
            return "microsoft" in f.read().lower()
    except OSError:
        return False


def probe_machine() -> MachineMemory:
    info = _meminfo()
    total = info.get("MemTotal", 0)
    available = info.get("MemAvailable", total)
    if sys.platform == "win32" or not info:  # no /proc: ask psutil if it is there
        try:
            import psutil

            vm = psutil.virtual_memory()
            total, available = vm.total, vm.available
        except ImportError:
            pass
    limit, used = _cgroup() if sys.platform.startswith("linux") else (None, 0)
    where = "windows" if sys.platform == "win32" else "wsl" if _is_wsl() else "linux"
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if hasattr(resource, "RLIMIT_MEMLOCK") else -1
    return MachineMemory(
        total_bytes=total,
        available_bytes=available,
        cgroup_limit_bytes=limit,
        cgroup_used_bytes=used,
        pinned_cap_bytes=total // 2 if where != "linux" else None,
        memlock_limit_bytes=None if soft < 0 or soft >= _UNLIMITED else soft,
        where=where,
    )
