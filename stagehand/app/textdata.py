"""Real text that every machine has: the Python standard library's own source, for the demo's byte-level LM.

The top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]``, in sorted order until `max_bytes`
(deterministic for a given Python version); batches are random windows drawn with a seeded generator.
"""

from __future__ import annotations

import glob
import os
import sysconfig

import torch


class CorpusError(RuntimeError):
    pass


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise CorpusError(f"no .py files in the standard library directory {root!r}")
    return files


def stdlib_corpus(max_bytes: int = 1_000_000) -> tuple[torch.Tensor, list[str]]:
    """(uint8 tensor of the text as int64 ids, files used)."""
    text, used = bytearray(), []
    for path in stdlib_files():
        with open(path, "rb") as f:
            data = f.read(max_bytes - len(text))
        if data:
            text += data
            used.append(path)
        if len(text) >= max_bytes:
            break
    return torch.frombuffer(text, dtype=torch.uint8).to(torch.int64), used


class ByteBatches:
    """Random windows of `seq` bytes, `batch` at a time, reproducible from `seed`."""

    def __init__(self, data: torch.Tensor, batch: int, seq: int, seed: int = 0):
        if data.numel() <= seq + 1:
            raise CorpusError(f"corpus has {data.numel()} bytes, fewer than one window of {seq + 1}")
        self.data, self.batch, self.seq = data, batch, seq
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.data.numel() - self.seq, (self.batch,), generator=self.generator)
        return torch.stack([self.data[s : s + self.seq] for s in starts.tolist()])
