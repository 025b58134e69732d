"""One piece of work on a thread of its own while the calling thread does another.

Offload fills the host store (copies that release the GIL) on a worker thread while the calling thread imports
the compiler and starts its workers. The imports stay on the calling thread: two threads importing one circle of
modules can each see the other's half-made module (compiler/inner.py).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def run_beside(work: Callable[[], T], on_calling_thread: Callable[[], None] | None, name: str,
               seconds: dict[str, float] | None = None) -> T:
    """`work()` on a thread named `name` while `on_calling_thread()` runs here; returns what `work` returned.

    The worker is always joined before this returns or raises, so nothing writes behind a caller that unwinds
    (offload puts the model back on an error). An error of `work` is raised here once both ended; if both
    failed, the calling thread's error is raised, with the worker's as its cause. `seconds`, when given, gets
    how long each side took ("work", "calling thread"). With nothing for the calling thread (a CPU offload
    prepares no compiler), `work` runs here: a thread would only wait."""
    seconds = {} if seconds is None else seconds

    def timed_work() -> T:
        start = time.perf_counter()
        try:
            return work()
        finally:
            seconds["work"] = time.perf_counter() - start

    if on_calling_thread is None:
        return timed_work()
    result: list = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            result.append(timed_work())
        except BaseException as error:  # noqa: BLE001 - handed to the calling thread, which raises it
            failed.append(error)

    worker = threading.Thread(target=target, name=name, daemon=True)
    worker.start()
    start = time.perf_counter()
    try:
        on_calling_thread()
    except BaseException as error:
        worker.join()
        if failed:
            raise error from failed[0]
        raise
    finally:
        seconds["calling thread"] = time.perf_counter() - start
    worker.join()
    if failed:
        raise failed[0]
    return result[0]
