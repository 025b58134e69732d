"""The W8A16 autotuner's choices, kept on disk across runs: a JSON file in `$STAGEHAND_CACHE_DIR` named by a
fingerprint of the device, the Triton and torch builds and the kernels' source (`STAGEHAND_TUNE_CACHE=0`: off). A
config read back is still checked once before use (`tune.pick`): a file that lies costs a re-tune, not a wrong number.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from typing import Any

import torch
from torch_stagehand.environment import cache_dir, env


def enabled() -> bool:
    return env("STAGEHAND_TUNE_CACHE")


def source_fingerprint() -> str:
    """A hash of the kernels' and the tuner's source: an edit to either starts a new cache file."""
    kernels = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kernels/, this file is in kernels/tuning/
    digest = hashlib.sha256()
    for name in ("w8a16.py", "launch.py", os.path.join("tuning", "autotune.py"), "grouped.py"):
        with open(os.path.join(kernels, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def fingerprint(device_name: str, capability: str) -> str:
    import triton

    parts = [device_name, capability, f"triton {triton.__version__}", f"torch {torch.__version__}", source_fingerprint()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _for_device(device_name: str, folder: str, index: int) -> "TuneCache":
    props = torch.cuda.get_device_properties(index)
    name = f"w8a16-{fingerprint(device_name, f'{props.major}.{props.minor}')}.json"
    return TuneCache(os.path.join(folder, name))


def key_text(key: tuple) -> str:
    """(kind, device, M bucket, N, K, dtype) -> a stable string (the device by name, not index)."""
    kind, _device, m_bucket, n, k, dtype = key
    return f"{kind}|{m_bucket}|{n}|{k}|{str(dtype).replace('torch.', '')}"


class TuneCache:
    """One device's tuned configs: key text -> config fields, loaded lazily, written on every new choice."""

    def __init__(self, path: str):
        self.path = path
        self._entries: dict[str, dict[str, Any]] | None = None

    @staticmethod
    def for_device(device: torch.device) -> "TuneCache":
        """One cache object per device and folder (its fingerprint hashes source files)."""
        return _for_device(torch.cuda.get_device_properties(device).name, cache_dir(), device.index or 0)

    def _load(self) -> dict[str, dict[str, Any]]:
        if self._entries is None:
            try:
                with open(self.path) as f:
                    entries = json.load(f)
                self._entries = entries if isinstance(entries, dict) else {}
            except (OSError, ValueError):
                self._entries = {}  # absent or unreadable: tune again (and rewrite it)
        return self._entries

    def get(self, key: tuple, config_type):
        fields = self._load().get(key_text(key))
        if not isinstance(fields, dict):
            return None
        try:
            return config_type(**fields)
        except TypeError:
            return None  # a field this Config no longer has: tune again

    def put(self, key: tuple, config) -> None:
        entries = self._load()
        entries[key_text(key)] = asdict(config)
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)  # atomic: a concurrent reader sees the old or the new file
        except OSError:  # a read-only home: the choice still holds for this process
            if "tmp" in locals() and os.path.exists(tmp):
                os.unlink(tmp)
