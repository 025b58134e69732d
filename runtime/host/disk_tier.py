"""The disk tier (`Config(int8_tier="disk")` with `offload(slab=...)`): INT8 blocks read from the slab at each fetch.

A block's bytes go from the file into one of a few pinned staging buffers and from there to its device slot. A
worker thread reads the next block in the fetches' direction while the current one computes; a buffer is read
into again once its H2D copy finished (its event waited on by the worker, never by the host).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from torch_stagehand.runtime.host.arena import HostArena
from torch_stagehand.runtime.precision import INT8, layer_views

RING = 3  # one buffer being copied to the device, one being read ahead, one spare


@dataclass
class _Staging:
    view: torch.Tensor
    block: int | None = None
    future: Future | None = None
    copy_done: object = None  # CUDA event after the H2D copy from this buffer
    used: int = 0


@dataclass
class DiskTierStats:
    reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    ready: int = 0  # fetches that found their block already read (the read-ahead worked)
    waited: int = 0  # fetches that waited for the disk

    def as_dict(self) -> dict:
        gbps = self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else None
        return {"reads": self.reads, "bytes_read": self.bytes_read, "read_seconds": round(self.read_seconds, 3),
                "read_gbps": None if gbps is None else round(gbps, 2), "ready": self.ready, "waited": self.waited}


class DiskTier:
    def __init__(self, reader, store, names: dict[int, list[str]], ring: int = RING):
        """reader: an open SlabReader (owned: closed with the tier); names: block -> slab layer names."""
        self.reader, self.store, self.names = reader, store, names
        size = max(store.nbytes(b, INT8) for b in names)
        self.arena = HostArena("int8 staging", [size] * ring, store.pinner)
        self.ring = [_Staging(self.arena.carve(size)) for _ in range(ring)]
        for s in self.ring:
            self.arena.lock(s.view)
        self.stats = DiskTierStats()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stagehand-disk")
        self._lock = threading.Lock()
        self._tick = 0
        self._last: int | None = None

    def fetch(self, block: int) -> torch.Tensor:
        """The block's INT8 bytes in a staging buffer (read now, or found read ahead)."""
        entry = self._entry(block)
        if entry is None:
            entry = self._start(block, keep=None)
        if entry.future.done():
            self.stats.ready += 1
        else:
            self.stats.waited += 1
        entry.future.result()  # a read error (SlabError naming the layer) surfaces here
        self._tick += 1
        entry.used = self._tick
        self._read_ahead(block, entry)
        return entry.view[: self.store.nbytes(block, INT8)]

    def copied(self, block: int, stream) -> None:
        """The H2D copy from the block's staging buffer was issued on `stream`: reuse it after that."""
        entry = self._entry(block)
        if entry is not None and stream is not None:
            entry.copy_done = torch.cuda.Event()
            entry.copy_done.record(stream)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.arena.close()
        self.reader.close()

    def _entry(self, block: int) -> _Staging | None:
        return next((s for s in self.ring if s.block == block), None)

    def _read_ahead(self, block: int, current: _Staging) -> None:
        step = -1 if self._last is not None and block < self._last else 1
        self._last = block
        upcoming = block + step
        if upcoming in self.names and self._entry(upcoming) is None:
            self._start(upcoming, keep=current)

    def _start(self, block: int, keep: _Staging | None) -> _Staging:
        victims = [s for s in self.ring if s is not keep]
        idle = [s for s in victims if s.future is None or s.future.done()]
        entry = min(idle or victims, key=lambda s: s.used)
        if entry.future is not None:
            entry.future.exception()  # wait for a read still going into it; its error is the fetch's, not ours
        entry.block, entry.used = block, self._tick
        entry.future = self._pool.submit(self._read, entry.view, block, entry.copy_done)
        entry.copy_done = None
        return entry

    def _read(self, view: torch.Tensor, block: int, copy_done) -> None:  # on the worker thread; the rest: the main one
        if copy_done is not None:
            copy_done.synchronize()  # the last H2D copy out of this buffer has finished
        t0 = time.perf_counter()
        for name, lay in zip(self.names[block], self.store.layout(block, INT8)):
            q, s = layer_views(view, lay)
            self.reader.read_layer_into(name, q, s)
        with self._lock:
            self.stats.reads += 1
            self.stats.bytes_read += self.store.nbytes(block, INT8)
            self.stats.read_seconds += time.perf_counter() - t0
