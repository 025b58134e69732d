"""Files read into the page cache before the disk gets busy: the compiler's modules ahead of a slab's reads.

Offload from a slab reads ~12 GB (Flux int8) on reader threads while its calling thread imports the compiler
and indexes the model's sources for Dynamo. On a cold page cache each of those few hundred small files waited
for a disk queue full of the slab's reads: the imports took 8.7-9.4 s beside the reads against 2.1-2.5 s from
the page cache (H100 machines), and offload waited for them 1.4 s past its last read. Read first, many at once
(small reads a disk serves side by side), while offload's stages before the reads run, they cost the imports
no wait beside the reads. A queued hint (`posix_fadvise(WILLNEED)` from a thread started beside the reads) did
not help: listing the folders and checking each file's bytecode waited behind the reads too.

Which files: the packages the compiler's preparation imports that an `import torch_stagehand` has not already
(Inductor, AOTAutograd, torch.export's serializer and torch.ao's quantization patterns, which Inductor's passes
import; Jinja2 and MarkupSafe for Inductor's templates), each module's bytecode where Python cached it (else its
source) and its source's inode (the import stats it to check the bytecode is fresh); and the model's source
files Dynamo will tokenize. A package that is missing, or a file that can not be read, is left to whoever
asks for it (the import says why): this only moves reads earlier.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

log = logging.getLogger("torch_stagehand.compiler")

# Under torch's folder (torch 2.11-2.13).
_TORCH_FOLDERS = ("_inductor", "_functorch", "_export", "export", "ao/quantization")
_PACKAGES = ("jinja2", "markupsafe")
# Small reads in flight at once: a disk serves them side by side (an NVMe drive queues hundreds).
_THREADS = 16
_CHUNK = 1 << 20


@dataclass
class ReadAheadStats:
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0


def compiler_folders() -> list[str]:
    """The folders whose modules the compiler's preparation imports (`_TORCH_FOLDERS`, `_PACKAGES`), those that
    exist here."""
    torch_dir = os.path.dirname(torch.__file__)
    folders = [os.path.join(torch_dir, *name.split("/")) for name in _TORCH_FOLDERS]
    for name in _PACKAGES:
        try:
            spec = importlib.util.find_spec(name)  # a top-level name: finds it without importing it
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            folders.extend(spec.submodule_search_locations)
    return [folder for folder in folders if os.path.isdir(folder)]


def read_ahead(folders: Sequence[str], files: Sequence[str] = (), threads: int = _THREADS) -> ReadAheadStats:
    """Every module under `folders` (its bytecode, else its source, and its source's inode) and each of `files`
    whole, read on `threads` threads; what was read (files, bytes) and how long it took."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="stagehand-read-ahead") as pool:
        sources: list[str] = []
        level = list(folders)
        while level:  # one level of folders at a time, each listed on a thread of its own
            scanned = list(pool.map(_scan, level))
            level = [sub for subs, _ in scanned for sub in subs]
            sources += [source for _, found in scanned for source in found]
        sizes = [*pool.map(_read_module, sources), *pool.map(_read_whole, files)]
    read = [n for n in sizes if n is not None]
    return ReadAheadStats(len(read), sum(read), time.perf_counter() - start)


class ReadAhead:
    """`read_ahead` on a thread of its own, started now; `wait()` joins it and returns what it read."""

    def __init__(self, folders: Sequence[str], files: Sequence[str] = ()):
        self._stats = ReadAheadStats()
        self._thread = threading.Thread(target=self._run, args=(list(folders), list(files)),
                                        name="stagehand-read-ahead", daemon=True)
        self._thread.start()

    def _run(self, folders: list[str], files: list[str]) -> None:
        try:
            self._stats = read_ahead(folders, files)
        except Exception as error:  # noqa: BLE001 - nothing is lost: the readers read what they need themselves
            log.debug("stagehand: read-ahead stopped: %s", error)

    def wait(self) -> ReadAheadStats:
        self._thread.join()
        return self._stats


def _scan(folder: str) -> tuple[list[str], list[str]]:
    """A folder's subfolders (not its bytecode cache: `_read_module` opens those files by name) and sources."""
    subfolders, sources = [], []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.endswith(".py"):
                    sources.append(entry.path)
                elif entry.name != "__pycache__" and entry.is_dir(follow_symlinks=False):
                    subfolders.append(entry.path)
    except OSError:
        pass
    return subfolders, sources


def _read_module(source: str) -> int | None:
    try:
        os.stat(source)  # the import's freshness check reads the source's inode
        cached = importlib.util.cache_from_source(source)
    except (OSError, NotImplementedError):  # (no bytecode cache in this Python: the source is what is read)
        cached = None
    read = _read_whole(cached) if cached is not None else None
    return read if read is not None else _read_whole(source)


def _read_whole(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    total = 0
    try:
        while chunk := os.read(fd, _CHUNK):
            total += len(chunk)
    except OSError:
        pass
    finally:
        os.close(fd)
    return total
