"""A model's safetensors checkpoint (a file, an index json, or a folder of either), mapped copy-on-write.

A tensor is a view of the mapping: nothing is read until its pages are touched (they are the page cache's), and a
write stays in this process. The views load a meta model without a second copy, and are the masters under
`keep_full="file"`.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from torch_stagehand.environment import tunable
from torch_stagehand.runtime.slab.errors import SlabError
from torch_stagehand.runtime.slab.safetensors_io import ST_DTYPES, read_header


class CheckpointError(ValueError):
    """A checkpoint that cannot serve the model: missing tensor, other shape or dtype, bad file (named)."""


PIPELINE_INDEX = "model_index.json"  # what makes a folder a diffusers pipeline's: one subfolder per model


def pipeline_components(folder: str | os.PathLike) -> dict[str, str]:
    """A diffusers pipeline folder's models, as its model_index.json lists them: subfolder -> class name (the
    subfolders there are); {} for any other folder."""
    folder = os.fspath(folder)
    try:
        with open(os.path.join(folder, PIPELINE_INDEX), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return {}
    return {name: entry[1] for name, entry in (index.items() if isinstance(index, dict) else ())
            if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)
            and os.path.isdir(os.path.join(folder, name))}


def pipeline_component(path: str | os.PathLike, class_names) -> tuple[str | os.PathLike, str | None]:
    """`path`, or where it is a diffusers pipeline folder, the subfolder its model_index.json gives a class of
    `class_names` (the model offloaded), with the line that says so; `path` itself when none or several match
    (`resolve_files` then names the subfolders)."""
    folder = os.fspath(path)
    if not os.path.isfile(os.path.join(folder, PIPELINE_INDEX)):
        return path, None
    components = pipeline_components(folder)
    match = [name for name, cls in components.items() if cls in class_names]
    if len(match) != 1:
        return path, None
    sub = os.path.join(folder, match[0])
    return sub, (f"stagehand offload: checkpoint {folder} is a diffusers pipeline folder: reading its "
                 f"{match[0]}/ ({components[match[0]]}, as model_index.json names it), {sub}")


def denoiser_first(components: dict[str, str]) -> list[str]:
    """A pipeline's subfolders, the denoiser's (`transformer/`, `unet/`) first: the one a user means to offload."""
    return [n for n in ("transformer", "unet") if n in components] + sorted(
        n for n in components if n not in ("transformer", "unet"))


def _pipeline_folder_error(folder: str) -> CheckpointError:
    """A pipeline folder given where one model's folder goes: name the subfolders to pass (the denoiser first)."""
    components = pipeline_components(folder)
    names = denoiser_first(components)
    with_weights = [n for n in names if any(".safetensors" in f for f in os.listdir(os.path.join(folder, n)))]
    listed = ", ".join(f"{os.path.join(folder, n)} ({components[n]})" for n in with_weights or names)
    return CheckpointError(f"checkpoint {folder!r}: a diffusers pipeline folder ({PIPELINE_INDEX}), not one model's: "
                           f"pass the subfolder of the model offloaded" + (f": {listed}" if listed else ""))


def resolve_files(path: str | os.PathLike) -> list[str]:
    """The .safetensors files a file, an index json or a folder names."""
    path = os.fspath(path)
    if os.path.isdir(path):
        index = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if index:
            path = os.path.join(path, index[0])
        else:
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files and os.path.isfile(os.path.join(path, PIPELINE_INDEX)):
                raise _pipeline_folder_error(path)
            if not files:
                raise CheckpointError(f"checkpoint {path!r}: the folder has no .safetensors file or index json")
            return files
    if path.endswith(".json"):
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint index {path!r}: cannot read its weight_map ({e})") from e
        return sorted({os.path.join(os.path.dirname(path), name) for name in weight_map.values()})
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r}: no such file or folder")
    return [path]


class _MappedFile:
    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            try:
                self.tensors = read_header(path, f.fileno(), any_dtype=True).tensors
            except SlabError as e:
                raise CheckpointError(f"checkpoint {path!r}: not a safetensors file ({e.detail})") from e
            # Never closed by hand (a view of a closed mapping would read freed memory): the views keep it alive.
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)  # (a safetensors file is never empty)


class WeightsFile:
    """Every tensor of a checkpoint (one file or shards), by name, as a view of its mapped file."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.files = [_MappedFile(p) for p in resolve_files(path)]
        self._where = {name: mf for mf in self.files for name in mf.tensors}
        self._tracked: list[tuple[torch.Tensor, int]] = []

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def view(self, name: str, track: bool = False) -> torch.Tensor:
        """The tensor as it is in the file; `track`: it may be written (a keep_full="file" master), so
        `release_pages` leaves the mapping alone once it was."""
        mf = self._where.get(name)
        if mf is None:
            sample = ", ".join(list(self._where)[:3])
            raise CheckpointError(f"checkpoint {self.path!r} has no tensor {name!r} (it has {sample}, ...)")
        info = mf.tensors[name]
        dtype = ST_DTYPES.get(info.dtype)
        if dtype is None:
            raise CheckpointError(f"checkpoint {mf.path!r}: tensor {name!r} has dtype {info.dtype}, not supported")
        if info.start % dtype.itemsize:
            raise CheckpointError(f"checkpoint {mf.path!r}: tensor {name!r} starts at byte {info.start}, not aligned "
                                  f"for {dtype}")
        # A tensor of its own on the mapping's storage (not a view): its own version counter, its writes its own.
        t = torch.empty(0, dtype=dtype).set_(mf.base.untyped_storage(), info.start // dtype.itemsize, info.shape)
        if track:
            self._tracked.append((t, t._version))
        return t

    def tensor_for(self, name: str, like: torch.Tensor, what: str, track: bool = False) -> torch.Tensor:
        """The file's tensor for `name`, checked against the model's (meta) tensor `like`."""
        t = self.view(name, track)
        if tuple(t.shape) != tuple(like.shape):
            raise CheckpointError(f"checkpoint {self._where[name].path!r}: {name} has shape {tuple(t.shape)}, the "
                                  f"model's {what} {tuple(like.shape)}")
        return t

    def read_ahead(self, names: Sequence[str], threads: int = 8) -> int:
        """The bytes of the tensors `names` into the page cache, on `threads` threads; returns how many were read.

        Read with `pread`, not through the mapping: the pages go to the page cache, not to this process, and a
        view faults them in from memory later (offload from a slab reads a meta model's resident tensors so,
        beside the slab's reads)."""
        return _read_ranges([(mf.path, mf.tensors[name].start, mf.tensors[name].end)
                             for name in names if (mf := self._where.get(name)) is not None], threads)

    def read_rows_ahead(self, rows_of: Sequence[tuple[torch.Tensor, Sequence[int]]], threads: int = 16) -> int:
        """The pages of some rows of 2-D views of this file (`rows_of`: (tensor, row indices)) into the page cache, a
        `pread` per row (rows closer than the tunable "weights_file_merge_gap" read as one); returns the bytes read.
        A tensor that is not a view of the file, or whose rows are not contiguous in it, is left out. For the slab
        identity's sampled rows; each read asks for no readahead (`POSIX_FADV_RANDOM`): the disk is the slab's."""
        ranges, by_storage = [], {mf.base.untyped_storage().data_ptr(): mf for mf in self.files}
        for t, rows in rows_of:
            mf = by_storage.get(t.untyped_storage().data_ptr())  # None: not a view of this file
            if mf is None or t.dim() != 2 or t.stride(1) != 1:
                continue
            start, item = t.data_ptr() - mf.base.data_ptr(), t.element_size()
            ranges += [(mf.path, start + r * t.stride(0) * item, start + (r * t.stride(0) + t.shape[1]) * item)
                       for r in rows if 0 <= r < t.shape[0]]
        return _read_ranges(ranges, threads, exact=True)

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
            mf.mm.madvise(advice)

    def release_pages(self) -> None:
        """Drop the mapped pages from this process (they stay in the page cache), where none was written:
        what was read to build the host store should not count in our RSS or cgroup."""
        if any(t._version != v for t, v in self._tracked):
            return  # a written page is this process's only copy of the write: never drop it
        self._advise(getattr(mmap, "MADV_DONTNEED", None))


def _read_ranges(ranges: list[tuple[str, int, int]], threads: int, exact: bool = False) -> int:
    """(path, begin, end) byte ranges into the page cache on `threads` threads, ranges closer than the tunable
    "weights_file_merge_gap" read as one and none longer than "weights_file_chunk" on one thread; returns the bytes
    read. `exact`: no readahead beyond each range (where the platform can say so)."""
    gap, chunk = tunable("weights_file_merge_gap"), tunable("weights_file_chunk")
    merged: list[list] = []
    for path, begin, end in sorted(ranges):
        if merged and merged[-1][0] == path and begin - merged[-1][2] <= gap:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([path, begin, end])
    chunks = [(path, at, min(end, at + chunk)) for path, begin, end in merged for at in range(begin, end, chunk)]
    if not chunks:
        return 0
    with ThreadPoolExecutor(max(1, min(threads, len(chunks))), thread_name_prefix="stagehand-pages-ahead") as pool:
        return sum(pool.map(lambda chunk: _read_range(*chunk, exact=exact), chunks))


def _read_range(path: str, begin: int, end: int, exact: bool = False) -> int:
    """`read_ahead`'s read of one range (0 where the file can not be read: its view's fault says why)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            if exact and hasattr(os, "posix_fadvise"):  # this descriptor's reads only: the others keep their readahead
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            return len(os.pread(fd, end - begin, begin))
        finally:
            os.close(fd)
    except OSError:
        return 0
