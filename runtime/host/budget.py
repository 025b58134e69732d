"""What the machine can give the host store (`probe_machine`, read before anything is allocated): MemAvailable,
the cgroup's limit (v2 or v1: past it the kernel OOM-kills), the pinned cap of Windows and WSL2 (about half the
RAM), and RLIMIT_MEMLOCK, reported only (CUDA's pinning is not bounded by it). Tests replace `probe_machine`.
"""

from __future__ import annotations

import contextlib
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


def _read(path: str) -> str:
    """The file's text ("" where it can not be read)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _meminfo() -> dict[str, int]:
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields:
            out[key] = int(fields[0]) * (1024 if len(fields) > 1 else 1)
    return out


def _read_int(path: str) -> int | None:
    text = _read(path).strip()
    if text == "max" or not text.isdigit():
        return None
    value = int(text)
    return None if value >= _UNLIMITED else value


def _cgroup() -> tuple[int | None, int]:
    """(limit, usage) of this process's memory cgroup; (None, 0) when there is none."""
    rel = ""
    for line in _read("/proc/self/cgroup").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) == 3 and parts[0] == "0":
            rel = parts[2]
    for base in (os.path.join("/sys/fs/cgroup", rel.lstrip("/")), "/sys/fs/cgroup"):
        limit = _read_int(os.path.join(base, "memory.max"))
        if limit is not None:
            return limit, _read_int(os.path.join(base, "memory.current")) or 0
    limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit is not None:
        return limit, _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
    return None, 0


def probe_machine() -> MachineMemory:
    info = _meminfo()
    total = info.get("MemTotal", 0)
    available = info.get("MemAvailable", total)
    if sys.platform == "win32" or not info:  # no /proc: ask psutil if it is there
        with contextlib.suppress(ImportError):
            import psutil

            vm = psutil.virtual_memory()
            total, available = vm.total, vm.available
    limit, used = _cgroup() if sys.platform.startswith("linux") else (None, 0)
    wsl = "microsoft" in _read("/proc/version").lower()
    where = "windows" if sys.platform == "win32" else "wsl" if wsl else "linux"
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if hasattr(resource, "RLIMIT_MEMLOCK") else -1
    return MachineMemory(total_bytes=total, available_bytes=available, cgroup_limit_bytes=limit, cgroup_used_bytes=used,
                         pinned_cap_bytes=total // 2 if where != "linux" else None,
                         memlock_limit_bytes=None if soft < 0 or soft >= _UNLIMITED else soft, where=where)
