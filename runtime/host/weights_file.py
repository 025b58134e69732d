"""A model's safetensors checkpoint, memory-mapped: tensors by name as views of the file.

`offload(model, checkpoint=...)` takes a `.safetensors` file, a
`*.safetensors.index.json` (transformers / diffusers shards), or a folder
holding either. Each file is mapped copy-on-write (`mmap.ACCESS_COPY`): a
tensor is a view of the mapping (no read, no copy until its pages are
touched; the pages are the page cache's, reclaimable), and a write to it
stays in this process (the file never changes). The views serve two things:

* loading without a second copy: a model built on the meta device gets its
  resident tensors one at a time, and its streamed weights go straight from
  the file into the host store;
* `keep_full="file"`: the streamed weights stay views of the file.

The format is the safetensors spec: 8 bytes little-endian header length, a JSON
header {name: {dtype, shape, data_offsets}}, then the data.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "BOOL": torch.bool}


# Reading pages ahead: ranges closer than this are read as one; none longer than a chunk goes to one thread.
_MERGE_GAP = 1 << 16
_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot serve the model: missing tensor, other shape or dtype, bad file (named)."""


def resolve_files(path: str | os.PathLike) -> list[str]:
    """The .safetensors files a file, an index json or a folder names."""
    path = os.fspath(path)
    if os.path.isdir(path):
        index = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if index:
            path = os.path.join(path, index[0])
        else:
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"checkpoint {path!r}: the folder has no .safetensors file or index json")
            return files
    if path.endswith(".json"):
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint index {path!r}: cannot read its weight_map ({e})") from e
        folder = os.path.dirname(path)
        return sorted({os.path.join(folder, name) for name in weight_map.values()})
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r}: no such file or folder")
    return [path]


class _MappedFile:
    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            try:
                (n,) = struct.unpack("<Q", f.read(8))
                self.header = json.loads(f.read(n))
            except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"checkpoint {path!r}: not a safetensors file ({e})") from e
            self.data_start = 8 + n
            # The mapping outlives the file object; torch's views keep it alive (it is never closed
            # by hand: a view of a closed mapping would read freed memory).
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.header.pop("__metadata__", None)
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8) if len(self.mm) else torch.empty(0, dtype=torch.uint8)


class WeightsFile:
    """Every tensor of a checkpoint (one file or shards), by name, as a view of its mapped file."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.files = [_MappedFile(p) for p in resolve_files(path)]
        self._where = {name: mf for mf in self.files for name in mf.header}
        self._tracked: list[tuple[torch.Tensor, int]] = []

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def view(self, name: str, track: bool = False) -> torch.Tensor:
        """The tensor as it is in the file; `track`: it may be written (a keep_full="file" master), so
        `release_pages` leaves the mapping alone once it was."""
        mf = self._where.get(name)
        if mf is None:
            sample = ", ".join(list(self._where)[:3])
            raise CheckpointError(f"checkpoint {self.path!r} has no tensor {name!r} (it has {sample}, ...)")
        info = mf.header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"checkpoint {mf.path!r}: tensor {name!r} has dtype {info['dtype']}, not supported")
        begin, end = (mf.data_start + o for o in info["data_offsets"])
        if begin % dtype.itemsize:
            raise CheckpointError(f"checkpoint {mf.path!r}: tensor {name!r} starts at byte {begin}, not aligned "
                                  f"for {dtype}")
        if end - begin != dtype.itemsize * _numel(info["shape"]):
            raise CheckpointError(f"checkpoint {mf.path!r}: tensor {name!r} has {end - begin} bytes for shape "
                                  f"{info['shape']} of {dtype}")
        # A tensor of its own on the mapping's storage (not a view of it): its own version counter,
        # so a write to one weight is seen as a write to that weight only.
        shape = tuple(info["shape"])
        t = torch.empty(0, dtype=dtype).set_(mf.base.untyped_storage(), begin // dtype.itemsize, shape,
                                             _contiguous_strides(shape))
        if track:
            self._tracked.append((t, t._version))
        return t

    def tensor_for(self, name: str, like: torch.Tensor, what: str, track: bool = False) -> torch.Tensor:
        """The file's tensor for `name`, checked against the model's (meta) tensor `like`."""
        t = self.view(name, track)
        if tuple(t.shape) != tuple(like.shape):
            raise CheckpointError(f"checkpoint {self.path!r}: {name} has shape {tuple(t.shape)}, the model's {what} "
                                  f"{tuple(like.shape)}")
        return t

    def read_ahead(self, names: Sequence[str], threads: int = 8) -> int:
        """The bytes of the tensors `names` into the page cache, on `threads` threads; returns how many were read.

        Read with `pread`, not through the mapping: the pages go to the page cache, not to this process, and a
        view faults them in from memory later. Offload from a slab reads a meta model's resident tensors this
        way beside the slab's reads (Flux: a few hundred tensors, most of them a few hundred bytes between the
        blocks' weights): faulted in one after another after the reads, each waited for the disk (0.6 s)."""
        return _read_ranges([(mf.path, *(mf.data_start + o for o in mf.header[name]["data_offsets"]))
                             for name in names if (mf := self._where.get(name)) is not None], threads)

    def read_rows_ahead(self, rows_of: Sequence[tuple[torch.Tensor, Sequence[int]]], threads: int = 16) -> int:
        """The pages of some rows of 2-D tensors that are views of this file (`rows_of`: (tensor, row indices))
        into the page cache, a `pread` per row (rows closer than `_MERGE_GAP` read as one, the bytes between
        them too), on `threads` threads; returns the bytes read. A tensor that is not a view of the file, or
        whose rows are not contiguous in it (a transposed weight), is left out.

        The slab identity's sampled rows (8 per layer, thousands in all) then fault in from memory: faulted
        from the disk under `random_access`, each row is read a page at a time, one page after another (a row
        of Flux's 12288-wide layers is six reads), beside the slab's reads. Each read asks the kernel for no readahead
        (`POSIX_FADV_RANDOM`): a row's bytes, not a window of several times its size taken from the slab's
        reads' share of the disk."""
        ranges = []
        for t, rows in rows_of:
            mf = self._file_of(t)
            if mf is None or t.dim() != 2 or t.stride(1) != 1:
                continue
            start, item = t.data_ptr() - mf.base.data_ptr(), t.element_size()
            ranges += [(mf.path, start + r * t.stride(0) * item, start + (r * t.stride(0) + t.shape[1]) * item)
                       for r in rows if 0 <= r < t.shape[0]]
        return _read_ranges(ranges, threads, exact=True)

    def _file_of(self, t: torch.Tensor) -> _MappedFile | None:
        """The mapped file `t` is a view of (None: memory of its own)."""
        storage = t.untyped_storage().data_ptr()
        return next((mf for mf in self.files if len(mf.mm) and mf.base.untyped_storage().data_ptr() == storage),
                    None)

    @contextlib.contextmanager
    def random_access(self):
        """Reads under it touch a few rows here and there (the slab identity's sampled rows): no readahead, so
        a checkpoint that is not in the page cache is read a few pages per row, not a megabyte per row."""
        random = getattr(mmap, "MADV_RANDOM", None)
        self._advise(random)
        try:
            yield self
        finally:
            self._advise(getattr(mmap, "MADV_NORMAL", None) if random is not None else None)

    def _advise(self, advice: int | None) -> None:
        """`madvise(advice)` on every mapped file (None: the platform lacks it, nothing to do)."""
        for mf in self.files if advice is not None else ():
            if len(mf.mm):
                mf.mm.madvise(advice)

    def release_pages(self) -> None:
        """Drop the mapped pages from this process (they stay in the page cache), where none was written:
        what was read to build the host store should not count in our RSS or cgroup."""
        if any(t._version != v for t, v in self._tracked):
            return  # a written page is this process's only copy of the write: never drop it
        self._advise(getattr(mmap, "MADV_DONTNEED", None))


def _read_ranges(ranges: list[tuple[str, int, int]], threads: int, exact: bool = False) -> int:
    """(path, begin, end) byte ranges into the page cache on `threads` threads, ranges closer than `_MERGE_GAP`
    read as one and none longer than `_CHUNK` on one thread; returns the bytes read. `exact`: no readahead
    beyond each range (where the platform can say so)."""
    merged: list[list] = []
    for path, begin, end in sorted(ranges):
        if merged and merged[-1][0] == path and begin - merged[-1][2] <= _MERGE_GAP:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([path, begin, end])
    chunks = [(path, at, min(end, at + _CHUNK)) for path, begin, end in merged for at in range(begin, end, _CHUNK)]
    if not chunks:
        return 0
    with ThreadPoolExecutor(max(1, min(threads, len(chunks))), thread_name_prefix="stagehand-pages-ahead") as pool:
        return sum(pool.map(lambda chunk: _read_range(*chunk, exact=exact), chunks))


def _read_range(path: str, begin: int, end: int, exact: bool = False) -> int:
    """`read_ahead`'s read of one range (0 where the file can not be read: its view's fault says why)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        if exact and hasattr(os, "posix_fadvise"):  # this descriptor's reads only: the others keep their readahead
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return len(os.pread(fd, end - begin, begin))
    except OSError:
        return 0
    finally:
        os.close(fd)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))
