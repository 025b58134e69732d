"""A slab's INT8 rows read by a process of their own, into pages this process maps (`Config(slab_reads=...)`).

Offload reads the slab beside the calling thread's compiler preparation, which
holds the GIL for most of the reads' seconds. Reader threads here wait for it
between reads and checks: Flux int8's 11.9 GB took 1.15-1.6x the disk's time
on H100 machines, and a CPU probe read 1.3 GB in 1.4 s alone, 5.3 s beside a
Python-busy thread. The reader process (read_worker.py) has a GIL of its own.

The pages: the INT8 arena (and a staging area for biases read from the slab)
are memfds this process maps (`ProcessPages`, a `HostArena` backing); the
worker maps the same files and `preadv`s each layer straight into its place.
The rows are not copied again (a meta model's biases are: float32 staging, cast
into their tensors after the reads); the arena is page-locked block by block as
each block's `["read", block]` arrives, as the reader threads do it.

Errors keep their names: a layer's failed check comes back as the
`SlabError` subclass `read_layer_into` raises, naming the layer and the file;
a worker that dies says how, with its last words. Nothing falls back to
threads on its own: `Config(slab_reads="threads")` is the way round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Iterable

import torch

from torch_stagehand.runtime.host_arena import map_memfd, new_memfd

from .errors import SlabChecksumError, SlabError, SlabTruncatedError, SlabUnsupportedError, SlabValueError
from .reader import SlabReader

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "read_worker.py")
_ERRORS = {"checksum": SlabChecksumError, "value": SlabValueError, "unsupported": SlabUnsupportedError,
           "truncated": SlabTruncatedError, "os": SlabError}


def process_reads_possible() -> str | None:
    """None where a reader process can fill this process's pages; else why not."""
    return None if hasattr(os, "memfd_create") else "this platform has no memfd_create"


class ProcessPages:
    """Host allocations on memfds of this process (a `HostArena` backing) that the reader process maps too."""

    def __init__(self):
        self.fds: list[int] = []
        self.spans: list[tuple[int, int]] = []  # (first address, bytes) of each mapping, in the order of fds

    def backing(self, kind: str, nbytes: int) -> torch.Tensor:
        fd = new_memfd(kind, max(nbytes, 1))  # (a mapping of 0 bytes can not be made)
        try:
            pages = map_memfd(fd, max(nbytes, 1))
        except BaseException:
            os.close(fd)
            raise
        self.fds.append(fd)
        self.spans.append((pages.data_ptr(), nbytes))
        return pages[:nbytes]

    def locate(self, t: torch.Tensor) -> list[int]:
        """[mapping index, byte offset] of a contiguous tensor in one of these mappings."""
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        for i, (start, size) in enumerate(self.spans):
            if start <= ptr and ptr + n <= start + size:
                return [i, ptr - start]
        raise ValueError(f"a buffer of {n} bytes at {ptr:#x} is in none of the reader process's pages")

    def close(self) -> None:
        """The files' descriptors go; the mappings keep the pages (they go with the last mapping)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def read_in_process(reader: SlabReader, pages: ProcessPages, blocks: Iterable[list],
                    while_reading: Callable[[], None] | None = None, clock=None,
                    on_block_read: Callable[[int], None] | None = None, threads: int = 8) -> None:
    """`_read_in_parallel`'s contract (loading.py) with the reads in a worker process: `blocks` yields a block's
    reads (name, qweight view, scale view, float32 bias view or None, spec) at a time, every buffer in `pages`;
    each list goes to the worker as it comes. `while_reading()` runs here meanwhile; `on_block_read(block)` runs
    (on a listener thread) once a block's layers are in. The first error is raised once the worker is gone: a
    layer's check (its SlabError), a layout error here (a read error that came before it is raised from it), or
    the worker's death."""
    stderr_file = tempfile.TemporaryFile()  # not a pipe: nothing has to drain it while the reads go on
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", WORKER, str(reader.fd), ",".join(map(str, pages.fds)), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr_file, text=True,
            pass_fds=(reader.fd, *pages.fds))
    except OSError as e:
        stderr_file.close()
        raise SlabError(f"could not start the slab reader process ({sys.executable} {WORKER}): {e}. "
                        "Config(slab_reads='threads') reads in this process instead", path=reader.path) from e
    failed: list[BaseException] = []
    ended = threading.Event()
    start = time.perf_counter()
    last_read = [start]

    def listen() -> None:  # the worker's events, as they come, to the end of its output
        for line in proc.stdout:
            try:
                heard(json.loads(line))
            except Exception as e:  # noqa: BLE001 - raised on the calling thread; the output is still drained
                failed.append(SlabError(f"the slab reader process said {line.strip()[:200]!r}: {e}",
                                        path=reader.path))
                proc.kill()

    def heard(event: list) -> None:
        if event[0] == "read":
            last_read.append(time.perf_counter())
            if on_block_read is not None and not failed:
                try:
                    on_block_read(event[1])
                except BaseException as e:  # noqa: BLE001 - raised on the calling thread
                    failed.append(e)
                    proc.kill()
        elif event[0] == "error":
            _block, kind, layer, message = event[1:]
            failed.append(_ERRORS[kind](message, path=reader.path, layer=layer))
            proc.kill()  # the reads still queued are not wanted
        elif event[0] == "end":
            ended.set()

    listener = threading.Thread(target=listen, name="stagehand-slab-reads", daemon=True)
    listener.start()
    try:
        try:
            for group in blocks:
                if failed:
                    break
                if not group:  # a block with nothing to read here
                    continue
                block = {r[4].block for r in group}
                if len(block) != 1:
                    raise ValueError(f"slab reads: a list holds the reads of blocks {sorted(block)}, not one")
                jobs = [reader.layer_job(name, q, s, bias, pages.locate) for name, q, s, bias, _spec in group]
                proc.stdin.write(json.dumps({"block": block.pop(), "layers": jobs}) + "\n")
                proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: its error or its exit status says why, below
        except BaseException as e:  # the layout failed: a read that failed before it is the error to name
            proc.kill()
            _finish(proc, listener, stderr_file)
            if failed:
                raise failed[0] from e
            raise
        _close_quietly(proc.stdin)
        if while_reading is not None and not failed:
            while_reading()
        stderr = _finish(proc, listener, stderr_file)
        if failed:
            raise failed[0]
        if not ended.is_set():
            raise SlabError(f"the slab reader process ({WORKER}) ended with exit status {proc.returncode} before "
                            f"every layer was read: {stderr.strip()[-2000:] or 'it said nothing'}. "
                            "Config(slab_reads='threads') reads in this process instead", path=reader.path)
        if clock is not None:
            clock.beside("slab reads", max(last_read) - start)
    finally:  # however it ended: the worker gone, and every block it read locked (or not) before the caller goes on
        if proc.poll() is None:
            proc.kill()
        _finish(proc, listener, stderr_file)
        stderr_file.close()


def _finish(proc: subprocess.Popen, listener: threading.Thread, stderr_file) -> str:
    """Wait for the worker and for the listener to hear its last event; what the worker wrote to its stderr."""
    _close_quietly(proc.stdin)
    listener.join()
    proc.wait()
    stderr_file.seek(0)
    return stderr_file.read().decode(errors="replace")


def _close_quietly(stream) -> None:
    try:
        stream.close()
    except BrokenPipeError:  # the worker is gone; its exit status says why
        pass
