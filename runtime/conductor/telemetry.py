"""Telemetry: one JSON line per step of what happened.

conductor.txt's fields where they apply (step_id, vram_allocated_mb, phase_durations) and the step's counters
(bytes moved, fetches, stalls, denials by reason, the precision map, `host_rss_mb` on Linux, CUDA memory).
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

# Records kept in memory (the file keeps them all): a run of a million steps must not grow the host's memory.
RECENT_RECORDS = 4096


class TelemetryWriter:
    def __init__(self, path: str | os.PathLike | None):
        self.path = None if path is None else os.fspath(path)
        if self.path is not None:
            _check_writable(self.path)
        self._file = None
        # The latest records, also kept in memory for plots and tests (bounded: long runs stay flat).
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_RECORDS)

    def write(self, record: dict[str, Any]) -> None:
        record = {"timestamp": time.time(), **record}
        rss = host_rss_bytes()
        if rss is not None:
            record.setdefault("host_rss_mb", round(rss / 2**20, 1))
        self.records.append(record)
        if self.path is None:
            return
        if self._file is None:
            self._file = open(self.path, "a", buffering=1)
        self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def host_rss_bytes() -> int | None:
    """This process's resident memory now (Linux /proc; None elsewhere): the telemetry's host memory."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class TelemetryPathError(ValueError):
    """`telemetry_file` cannot be written: caught at offload, not at the first step."""


def _check_writable(path: str) -> None:
    """Refuse a telemetry path the first step could not open (nothing is created here)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise TelemetryPathError(f"telemetry_file: {path!r} is a directory; name a file (e.g. {path}/telemetry.jsonl)")
    if not os.path.isdir(parent):
        raise TelemetryPathError(f"telemetry_file: {path!r}: its folder {parent!r} does not exist")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise TelemetryPathError(f"telemetry_file: {path!r} is not writable")
