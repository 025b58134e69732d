"""What offload's calling thread does for the compiler while other threads fill the host store (on CUDA): start
Inductor's compile workers, import the compiler, index the model's sources for Dynamo (compiler/inner.py); before
a slab's reads, the files this work opens are read ahead (read_ahead.py), else each would wait behind the slab.
"""

from __future__ import annotations

import sys
import time

import torch

from torch_stagehand.compiler.inner import dynamo_source_files, prewarm_compiler_imports, warm_compile_workers
from torch_stagehand.compiler.startup.read_ahead import ReadAhead, ReadAheadStats, compiler_roots


class CompilerPreparation:
    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.sources = dynamo_source_files(model)  # read before the weights move (a worker replaces the Parameters)
        self._files: ReadAhead | None = None
        self.seconds: dict[str, float] = {}  # each part's, once it ran (offload's report lists them)

    def read_files_ahead(self) -> None:
        """Start reading the compiler's and the model's files into the page cache, on threads; not where the
        compiler is imported already (a second offload: nothing here reads them again)."""
        if self._files is None and not _compiler_imported():
            packages, bytecode = compiler_roots()
            self._files = ReadAhead(packages, bytecode, self.sources)

    def files_read(self) -> ReadAheadStats:
        """Wait for `read_files_ahead` (nothing to wait for where it was not started)."""
        return self._files.wait() if self._files is not None else ReadAheadStats()

    def __call__(self) -> None:
        start = time.perf_counter()
        warm_compile_workers(self.device)  # (Inductor hashes torch's sources for them: `torch_key`)
        started = time.perf_counter()
        prewarm_compiler_imports(self.sources)
        self.seconds = {"compile workers started": started - start,
                        "compiler imported, sources indexed": time.perf_counter() - started}


def _compiler_imported() -> bool:
    return "torch._inductor.compile_fx" in sys.modules


def compiler_preparation(model: torch.nn.Module, device: torch.device) -> CompilerPreparation | None:
    """The preparation for `model` on `device`; None off CUDA (a CPU run compiles nothing ahead)."""
    return CompilerPreparation(model, device) if device.type == "cuda" else None
