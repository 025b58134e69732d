"""Variants compiled ahead of need, in worker processes (compiler/startup/ahead_worker.py). A recomputed block's
first forward runs under no_grad, so it need not wait for its variant: the unit (units.BlockUnit._compile_ahead)
hands the variant to a worker and runs the graph eagerly. A worker compiles into torch's own caches, from which the
main process's compile later loads. Nothing depends on a worker being right: a job still queued when asked for is
dropped, a running one is waited for, a failed one or a cache miss costs the main process its own compile. Workers
compile under the main process's config and process settings (process_settings.py) and allocate no device tensor."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Hashable

from torch_stagehand.compiler.startup import process_settings
from torch_stagehand.compiler.startup.ahead_wire import receive, send
from torch_stagehand.environment import child_environment, env

log = logging.getLogger("torch_stagehand.compiler")


@dataclass
class AheadJob:
    key: Hashable  # the variant cache key the main process will ask for
    label: str
    graph: bytes  # the variant graph, as `pickle_graph` writes it
    code: str  # its code: the worker checks that it unpickled the same graph (the caches key on the code)
    inputs: list  # input_specs
    grad: bool  # grad mode the variant runs in
    replay_rng: bool
    joint_passes: tuple[Callable, ...]
    cacheable: dict[str, str] = field(default_factory=dict)  # the main process's cacheable_functions() (in every key)
    settings: dict[str, Any] = field(default_factory=process_settings.current)  # the main process's (in no key)


@dataclass
class AheadResult:
    """How a worker's compile went: `state` as compile_cache.CompileOutcome's, or `error`."""

    seconds: float = 0.0
    state: str = ""
    error: str = ""
    cuda_context: bool = False  # the worker holds a CUDA context (it compiled for the device)
    settings: dict[str, Any] = field(default_factory=dict)  # the worker's process_settings while it compiled

    def describe(self) -> str:
        if self.error:
            return f"its ahead compile failed ({self.error.strip().splitlines()[-1]})"
        context = "; the worker holds a CUDA context" if self.cuda_context else ""
        return f"compiled ahead in a worker in {self.seconds:.1f}s ({self.state}{context})"


_RESULT_FIELDS = {f.name for f in fields(AheadResult)}


class _Worker:
    """One worker process and the thread feeding it the shared queue's jobs; it ends with the pool or when idle."""

    def __init__(self, pool: "AheadCompiler", w8a16: dict | None = None):
        self.pool = pool
        self.jobs_done = 0
        # Each worker's Triton compile pool gets its share of the cores, or STAGEHAND_AHEAD_THREADS.
        threads = max(1, _ahead_threads() or (os.cpu_count() or 1) // pool.size)
        limit = env("TORCHINDUCTOR_COMPILE_THREADS")
        if limit is not None and limit > 0:  # the user's cap on Inductor's threads holds for the workers too
            threads = min(threads, limit)
        child = child_environment(PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                                  TORCHINDUCTOR_COMPILE_THREADS=str(threads))
        self.process = subprocess.Popen([sys.executable, "-m", "torch_stagehand.compiler.startup.ahead_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=None if env("STAGEHAND_AHEAD_DEBUG") else subprocess.DEVNULL, env=child)
        send(self.process.stdin, dict(pool.configs, w8a16=w8a16))
        self.thread = threading.Thread(target=self._run, name="stagehand-ahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while (item := self._next()) is not None:
                job, future = item
                if not future.set_running_or_notify_cancel():
                    continue  # dropped while queued: the main process compiled it itself
                try:
                    send(self.process.stdin, job)
                    reply = receive(self.process.stdout)
                except (OSError, ValueError) as e:
                    reply = {"error": f"the worker is gone ({e})"}
                if reply is None:
                    reply = {"error": f"the worker exited (code {self.process.poll()})"}
                self.jobs_done += 1
                # the fields this process knows; a reply may carry more (a worker of another version)
                future.set_result(AheadResult(**{k: v for k, v in reply.items() if k in _RESULT_FIELDS}))
        finally:
            self.end()

    def _next(self):
        """The next job, or None: the pool closed, or it stayed idle (`pool.idle_s` after a job, ten times that
        before the first: a pool started at offload waits out the offload), and this worker left the pool."""
        while True:
            try:
                return self.pool.jobs.get(timeout=self.pool.idle_s * (1 if self.jobs_done else 10))
            except queue.Empty:
                with self.pool.lock:
                    if self.pool.jobs.empty():
                        self.pool.workers.discard(self)
                        return None

    def end(self, deadline: float | None = None) -> None:
        """End the process at its closed stream; one still compiling at `deadline` (default: in 5 s) is killed
        (torch writes its cache entries whole, under a temporary name)."""
        self.close_input()
        deadline = time.monotonic() + 5 if deadline is None else deadline
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(OSError):
            self.process.stdout.close()

    def close_input(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()


class AheadCompiler:
    """Worker processes that compile foreseen variants into torch's caches (module doc)."""

    def __init__(self, workers: int, idle_s: float = 30.0, wait_s: float = 900.0, w8a16: dict | None = None):
        self.size = workers
        # {"device", "dtype" (name), "shapes"}: W8A16 kernels the workers compile as they start (`_w8a16_share`).
        self.w8a16 = w8a16
        self.idle_s = idle_s  # a worker without a job this long ends
        self.wait_s = wait_s  # the longest the main process waits for a job a worker is on
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.workers: set[_Worker] = set()
        self.futures: dict[Hashable, Future] = {}
        self.held: list[tuple[AheadJob, Future]] = []  # jobs submitted `later`, queued at the first `take`
        # Per job, how the main process loads what its worker compiled ahead of the step asking (`take`).
        self.preloads: dict[Hashable, Callable[[], None]] = {}
        self.preloaded: list[str] = []  # the jobs loaded while the step waited for another, by label
        self.configs: dict[str, Any] = {}
        self.waited_s = 0.0  # the main process's time spent waiting for jobs a worker was on
        self.busy_waiting_s = 0.0  # of which it spent working (`take`'s while_waiting, then loading finished jobs)
        self.dropped = 0  # jobs dropped while queued (the main process compiled them itself)
        self.worker_pids: list[int] = []
        self.refused: list[str] = []  # variants not handed over (their graph or inputs would not travel), and why
        self.labels: dict[Hashable, str] = {}  # per job submitted
        self._closed = False

    @property
    def stats(self) -> dict[str, Any]:
        return {"submitted": len(self.futures), "waited_s": self.waited_s, "busy_waiting_s": self.busy_waiting_s,
                "dropped": self.dropped, "preloaded": list(self.preloaded),
                "worker_pids": list(self.worker_pids), "refused": list(self.refused)}

    def submit(self, job: AheadJob, later: bool = False, preload: Callable[[], None] | None = None) -> bool:
        """Queue `job` unless its variant was asked for before; True when queued. `later`: held back until the
        first `take` (an inference variant must not keep a worker from a training variant the backward waits for).
        `preload()`: loads the finished variant; `take` calls it while the step waits for another job."""
        if self.size <= 0 or self._closed or job.key in self.futures:
            return False
        future: Future = Future()
        self.futures[job.key] = future
        self.labels[job.key] = job.label
        if preload is not None:
            self.preloads[job.key] = preload
        with self.lock:
            if later:
                self.held.append((job, future))
            else:
                self.jobs.put((job, future))
            self._start_workers()
        log.info("stagehand: compiling %s ahead, in a worker%s", job.label, " (after the training variants)"
                 if later else "")
        return True

    def start(self) -> "AheadCompiler":
        """Start the workers now, under the Inductor and AOTAutograd config of this moment (offload does)."""
        with self.lock:
            if not self._closed:
                self._start_workers()
        return self

    def _start_workers(self) -> None:
        """Fill the pool up to its size (under `self.lock`)."""
        if not self.configs:
            self.configs = _configs()
            atexit.register(self.close)
            if env("STAGEHAND_AHEAD_DEBUG"):  # this side's cache key details too, on stderr beside the workers'
                keys = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
                keys.setLevel(logging.DEBUG)
                keys.addHandler(logging.StreamHandler())
        while len(self.workers) < self.size:
            worker = _Worker(self, self._w8a16_share(len(self.worker_pids)))
            self.workers.add(worker)
            self.worker_pids.append(worker.process.pid)

    def _w8a16_share(self, index: int) -> dict | None:
        """What the `index`-th worker started compiles of `w8a16`: the provisional kernel (the first), its share of
        the tuning candidates (each of the first `size`); None for a worker started after one left."""
        if not self.w8a16 or index >= self.size:
            return None
        return dict(self.w8a16, provisional=index == 0, share=(index, self.size))

    def take(self, key: Hashable, while_waiting: Callable[[Callable[[], bool]], Any] | None = None
             ) -> AheadResult | None:
        """Before the main process compiles `key`: wait for its job if a worker is on it, drop it if still queued
        (None: no job, or dropped). While waiting: `while_waiting(done)`, then preload other finished jobs."""
        with self.lock:  # the main process waits now: the forward has handed over its training variants
            for item in self.held:
                self.jobs.put(item)
            self.held.clear()
        future = self.futures.get(key)
        if future is None:
            return None
        self.preloads.pop(key, None)  # asked for now: the caller loads it (or compiles it, if dropped)
        if future.cancel():
            self.dropped += 1
            return None
        start = time.perf_counter()
        if not future.done():  # the work put off for the wait, then the variants other workers finished
            if while_waiting is not None:
                while_waiting(future.done)
            while not future.done() and self._preload_one():
                pass
            self.busy_waiting_s += time.perf_counter() - start
        try:
            result = future.result(timeout=self.wait_s)
        except FutureTimeout:  # a worker stuck: the main process compiles the variant itself
            result = AheadResult(error=f"no answer from its worker in {self.wait_s:.0f}s")
        self.waited_s += time.perf_counter() - start
        return result

    def _preload_one(self) -> bool:
        """Load one finished, unfailed job the step has not asked for yet; False when none is left."""
        for key, future in list(self.futures.items()):
            if key not in self.preloads or not future.done() or future.cancelled() or future.result().error:
                continue
            preload = self.preloads.pop(key)
            try:
                preload()
                self.preloaded.append(self.labels[key])
            except Exception as e:  # noqa: BLE001 - only a speed-up: the step loads it where it asks for it
                log.warning("stagehand: loading %s ahead failed (%s: %s); it loads where the step asks for it",
                            self.labels[key], type(e).__name__, e)
            return True
        return False

    def close(self) -> None:
        """Drop the queued jobs and end the workers (the runtime closed, or the process exits)."""
        self._closed = True
        self.preloads.clear()  # they hold the inputs of the forward that made their job
        for future in self.futures.values():
            future.cancel()
        with self.lock:
            workers, self.workers = list(self.workers), set()
        for _ in workers:
            self.jobs.put(None)
        for worker in workers:  # all told at once, then all given the same few seconds
            worker.close_input()
        deadline = time.monotonic() + 5
        for worker in workers:
            worker.end(deadline)


def _ahead_threads() -> int:
    """`STAGEHAND_AHEAD_THREADS`: each worker's Triton compile threads (0 or unset: cores / workers)."""
    return env("STAGEHAND_AHEAD_THREADS")


def _configs() -> dict[str, Any]:
    """The Inductor and AOTAutograd config now (a user's patch included): part of every cache key."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    return {"inductor": inductor_config.save_config_portable(), "functorch": functorch_config.save_config_portable()}
