"""A slab's INT8 rows read by a process of its own (read_worker.py), whose reads never wait for this process's GIL
(`Config(slab_reads=...)`). The INT8 arena and a float32 staging area for meta biases are memfds (`ProcessPages`)
the worker maps and `preadv`s into; each block is page-locked here as its ``["read", b]`` arrives. With `behind`,
the reads still going come back as a `RowsBehind`. A failed check is the `SlabError` `read_layer_into` raises."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Iterable

import torch

from torch_stagehand.runtime.host.arena import map_memfd, new_memfd

from torch_stagehand.runtime.slab.errors import SlabChecksumError, SlabError, SlabTruncatedError, SlabUnsupportedError, SlabValueError
from torch_stagehand.runtime.slab.reader import SlabReader

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
                    on_block_read: Callable[[int], None] | None = None, threads: int = 8,
                    behind: bool = False) -> "RowsBehind | None":
    """`_read_in_parallel`'s contract (loading.py) with the reads in a worker process: `blocks` yields a block's
    reads (name, qweight view, scale view, float32 bias view or None, spec) at a time, every buffer in `pages`.
    `on_block_read(block)` runs on a listener thread. The first error (a layer's SlabError, a layout error here,
    the worker's death) is raised once the worker is gone. `behind`: once every block is handed over and
    `while_reading()` is done, return the reads still going as a `RowsBehind` (an error so far is raised here)."""
    worker = _Worker(reader, pages, threads, on_block_read)
    handed_over = False
    try:
        worker.hand_over(blocks)
        if while_reading is not None and not worker.failed:
            while_reading()
        if behind and not worker.failed and not worker.gone_early():
            handed_over = True
            return RowsBehind(worker, clock)
        worker.finish()
        if clock is not None:
            clock.beside("slab reads", worker.seconds())
        return None
    finally:  # however it ended (but handed over): the worker gone, every block it read locked (or not)
        if not handed_over:
            worker.kill()


class _Worker:
    """The reader process, the listener thread that hears its events, and what it said."""

    def __init__(self, reader: SlabReader, pages: ProcessPages, threads: int,
                 on_block_read: Callable[[int], None] | None):
        self.path = reader.path
        self.stderr_file = tempfile.TemporaryFile()  # not a pipe: nothing has to drain it while the reads go on
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", WORKER, str(reader.fd), ",".join(map(str, pages.fds)), str(threads)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr_file, text=True,
                pass_fds=(reader.fd, *pages.fds))
        except OSError as e:
            self.stderr_file.close()
            raise SlabError(f"could not start the slab reader process ({sys.executable} {WORKER}): {e}. "
                            "Config(slab_reads='threads') reads in this process instead", path=reader.path) from e
        self.reader, self.pages, self.on_block_read = reader, pages, on_block_read
        self.failed: list[BaseException] = []
        self.blocks_in: set[int] = set()  # read, and on_block_read done
        self.ended = threading.Event()
        self.start = time.perf_counter()
        self.last_read = self.start
        self.listener = threading.Thread(target=self._listen, name="stagehand-slab-reads", daemon=True)
        self.listener.start()
        self._finished: str | None = None  # the worker's stderr, once it is gone

    def _listen(self) -> None:  # the worker's events, as they come, to the end of its output
        for line in self.proc.stdout:
            try:
                self._heard(json.loads(line))
            except Exception as e:  # noqa: BLE001 - raised on the calling thread; the output is still drained
                self.failed.append(SlabError(f"the slab reader process said {line.strip()[:200]!r}: {e}",
                                             path=self.path))
                self.proc.kill()

    def _heard(self, event: list) -> None:
        if event[0] == "read":
            self.last_read = time.perf_counter()
            if self.on_block_read is not None and not self.failed:
                try:
                    self.on_block_read(event[1])
                except BaseException as e:  # noqa: BLE001 - raised on the calling thread
                    self.failed.append(e)
                    self.proc.kill()
            self.blocks_in.add(event[1])
        elif event[0] == "error":
            _block, kind, layer, message = event[1:]
            self.failed.append(_ERRORS[kind](message, path=self.path, layer=layer))
            self.proc.kill()  # the reads still queued are not wanted
        elif event[0] == "end":
            self.ended.set()

    def hand_over(self, blocks: Iterable[list]) -> None:
        """Each block's reads to the worker as `blocks` yields them, then its input closed."""
        try:
            for group in blocks:
                if self.failed:
                    break
                if not group:  # a block with nothing to read here
                    continue
                block = {r[4].block for r in group}
                if len(block) != 1:
                    raise ValueError(f"slab reads: a list holds the reads of blocks {sorted(block)}, not one")
                jobs = [self.reader.layer_job(name, q, s, bias, self.pages.locate) for name, q, s, bias, _ in group]
                self.proc.stdin.write(json.dumps({"block": block.pop(), "layers": jobs}) + "\n")
                self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: its error or its exit status says why, in finish()
        except BaseException as e:  # the layout failed: a read that failed before it is the error to name
            self.kill()
            if self.failed:
                raise self.failed[0] from e
            raise
        _close_quietly(self.proc.stdin)

    def finish(self) -> None:
        """Wait for the worker's end; raise the first error, or its death."""
        stderr = self._wait()
        if self.failed:
            raise self.failed[0]
        if not self.ended.is_set():
            raise SlabError(f"the slab reader process ({WORKER}) ended with exit status {self.proc.returncode} "
                            f"before every layer was read: {stderr.strip()[-2000:] or 'it said nothing'}. "
                            "Config(slab_reads='threads') reads in this process instead", path=self.path)

    def gone_early(self) -> bool:
        """The worker ended before saying every block was read (offload then raises why, not the first step)."""
        return self.proc.poll() is not None and not self.ended.is_set()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self._wait()

    def seconds(self) -> float:
        """From the worker's start to its last block read."""
        return self.last_read - self.start

    def _wait(self) -> str:
        """Wait for the worker and the listener's last event; returns the worker's stderr."""
        if self._finished is None:
            _close_quietly(self.proc.stdin)
            self.listener.join()
            self.proc.wait()
            self.stderr_file.seek(0)
            self._finished = self.stderr_file.read().decode(errors="replace")
            self.stderr_file.close()
        return self._finished


class RowsBehind:
    """A slab's rows still read by the reader process after offload returned (`Config(slab_rows_behind=True)`).

    The host store asks `waiting(block)` before it page-locks a buffer (the listener locks each block as its rows
    come in) and calls `wait()` before any buffer's bytes are read: the first fetch waits for the reads' end. A
    failed check or a dead worker is raised by that wait and by every one after it; the model is not put back
    then (offload has returned): `close()` it and offload again."""

    def __init__(self, worker: _Worker, clock=None):
        self._worker = worker
        self._clock = clock
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.done = False
        self.waited_s = 0.0  # what the waits here waited for the reads' end, in all

    def waiting(self, block: int) -> bool:
        """The block's rows are not in yet (nor page-locked by the listener)."""
        return not self.done and block not in self._worker.blocks_in

    @property
    def blocks_in(self) -> int:
        return len(self._worker.blocks_in)

    def wait(self) -> None:
        """Every block's rows in; or the reads' error, raised again on every call."""
        with self._lock:
            if self._error is not None:  # (without the traceback of the step that first raised it)
                raise self._error.with_traceback(None)
            if self.done:
                return
            start = time.perf_counter()
            try:
                self._worker.finish()
            except Exception as e:  # the reads' error; an interrupt of the wait is not theirs: the next wait waits
                self._error = e
                raise
            finally:
                self.waited_s += time.perf_counter() - start
            self.done = True
            if self._clock is not None:
                self._clock.beside("slab reads", self._worker.seconds())

    def cancel(self) -> None:
        """The reads are not wanted (the store is freed): the worker killed, the listener gone."""
        with self._lock:
            if not self.done:
                self._worker.kill()
                self._error = self._error or SlabError("the slab's reads were cancelled (the store was freed)",
                                                       path=self._worker.path)

    def summary(self) -> dict:
        """For the runtime's stats: how long the reads took (so far) and how long fetches waited for them."""
        return {"blocks_in": self.blocks_in, "done": self.done, "reads_s": round(self._worker.seconds(), 3),
                "waited_s": round(self.waited_s, 3), "error": "" if self._error is None else str(self._error)}


def _close_quietly(stream) -> None:
    with contextlib.suppress(BrokenPipeError):  # the worker is gone; its exit status says why
        stream.close()
