"""Files read into the page cache before the disk gets busy: the compiler's files ahead of a slab's reads. Beside a
slab's reads every file offload's calling thread opens (torch's sources hashed by `torch_key`, the compiler's
imports, the model's sources Dynamo tokenizes) waits behind a full disk queue; read first, many at once, they cost no
wait: every module of torch, Jinja2 and MarkupSafe, the bytecode of the compiler's modules (`_TORCH_FOLDERS`), and
the model's source files. A file that cannot be read is left to whoever asks."""

from __future__ import annotations

import importlib.machinery
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

# Under torch's folder (torch 2.11-2.13): the compiler's modules, whose bytecode is read too.
_TORCH_FOLDERS = ("_inductor", "_functorch", "_export", "export", "ao/quantization")
_PACKAGES = ("jinja2", "markupsafe")
# Small reads in flight at once: a disk serves them side by side (a cloud or NVMe disk queues dozens or more).
_THREADS = 16
_CHUNK = 1 << 20
# An extension module's file by its ABI-tagged suffix (as `torch_key` reads torch/_C's), not any shared library.
_EXTENSIONS = tuple(s for s in importlib.machinery.EXTENSION_SUFFIXES if s != ".so")


@dataclass
class ReadAheadStats:
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0


def compiler_roots() -> tuple[list[str], list[str]]:
    """(packages whose every module's source is read, folders whose modules' bytecode is read too), where they
    exist: torch, Jinja2 and MarkupSafe; `_TORCH_FOLDERS` and those two."""
    torch_dir = os.path.dirname(torch.__file__)
    packages = []
    for name in _PACKAGES:
        try:
            spec = importlib.util.find_spec(name)  # a top-level name: finds it without importing it
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            packages.extend(spec.submodule_search_locations)
    bytecode = [os.path.join(torch_dir, *name.split("/")) for name in _TORCH_FOLDERS] + packages
    return ([p for p in [torch_dir, *packages] if os.path.isdir(p)], [f for f in bytecode if os.path.isdir(f)])


def read_ahead(packages: Sequence[str], bytecode: Sequence[str] = (), files: Sequence[str] = (),
               threads: int = _THREADS) -> ReadAheadStats:
    """`files_ahead(packages, bytecode, files)` read whole (and listed) on `threads` threads; what was read."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="stagehand-read-ahead") as pool:
        sizes = list(pool.map(_read_whole, files_ahead(packages, bytecode, files, pool)))
    read = [n for n in sizes if n is not None]
    return ReadAheadStats(len(read), sum(read), time.perf_counter() - start)


def files_ahead(packages: Sequence[str], bytecode: Sequence[str] = (), files: Sequence[str] = (),
                pool: ThreadPoolExecutor | None = None) -> list[str]:
    """Every module file of `packages` and their subpackages (folders with an `__init__.py`), its bytecode's file
    where under one of the `bytecode` folders; then `files`. The folders are listed on `pool`'s threads, if given."""
    under = tuple(os.path.join(folder, "") for folder in bytecode)
    scan = pool.map if pool is not None else map
    modules: list[str] = []
    level = [(folder, True) for folder in packages]
    while level:  # one level of folders at a time
        scanned = [found for found in scan(lambda job: _scan(*job), level) if found[2] or found[3]]
        level = [(sub, False) for subs, _, _, _ in scanned for sub in subs]
        modules += [module for _, found, _, _ in scanned for module in found]
    cached = (_bytecode(m) for m in modules if m.endswith(".py") and m.startswith(under))
    return [*modules, *(path for path in cached if path is not None), *files]


class ReadAhead:
    """`read_ahead` on a thread of its own, started now; `wait()` joins it and returns what it read."""

    def __init__(self, packages: Sequence[str], bytecode: Sequence[str] = (), files: Sequence[str] = ()):
        self._stats = ReadAheadStats()
        self._thread = threading.Thread(target=self._run, args=(list(packages), list(bytecode), list(files)),
                                        name="stagehand-read-ahead", daemon=True)
        self._thread.start()

    def _run(self, packages: list[str], bytecode: list[str], files: list[str]) -> None:
        try:
            self._stats = read_ahead(packages, bytecode, files)
        except Exception as error:  # noqa: BLE001 - nothing is lost: the readers read what they need themselves
            log.debug("stagehand: read-ahead stopped: %s", error)

    def wait(self) -> ReadAheadStats:
        self._thread.join()
        return self._stats


def _scan(folder: str, root: bool = False) -> tuple[list[str], list[str], bool, bool]:
    """A folder's subfolders (not `__pycache__`), its modules' files, whether it is a package, and `root`."""
    subfolders, modules = [], []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.endswith((".py", *_EXTENSIONS)):
                    modules.append(entry.path)
                elif entry.name != "__pycache__" and entry.is_dir(follow_symlinks=False):
                    subfolders.append(entry.path)
    except OSError:
        pass
    return subfolders, modules, any(os.path.basename(m) == "__init__.py" for m in modules), root


def _bytecode(source: str) -> str | None:
    try:
        return importlib.util.cache_from_source(source)
    except NotImplementedError:  # no bytecode cache in this Python: the source is what an import reads
        return None


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
