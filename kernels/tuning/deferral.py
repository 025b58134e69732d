"""W8A16 tuning put off, and done while the step waits for something else.

A cold first step with ahead-compile workers (compiler/startup/ahead.py) runs each block structure's first forward
eagerly while a worker compiles it, and hands the next structure to a worker when the forward reaches it. A
W8A16 key met in that forward would be tuned there (kernels/tuning/autotune.py: a second or more per key), holding the forward, and
with it the next structure's job: full-size Flux int8's double blocks' four keys, 4-5 s, stood between the two
structures' jobs. Under `deferred()` such a key runs `tune.provisional_config` (right, not the fastest; its launch
is not kept for replay) and is queued with a call that tunes it on stand-in tensors of the same shapes. The
step's backward then waits for the worker anyway, and `tune_deferred` tunes the queue meanwhile, until the
worker is done; a key left is tuned where it is next asked for, as without the deferral.

While it does, the threads that compile the candidates yield the CPU (`yield_cpu`: nice 10, per thread, and the
ptxas each starts): the worker's compile is the step's critical path, and the two share the cores (Flux int8 on
16 cores: its 8 keys took 16 s beside two compiling workers, against 9 s in the forward).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable

_PENDING: dict[tuple, Callable[[], None]] = {}  # key -> a call that tunes it on stand-in tensors
_DEFERRING = threading.local()
_YIELDING = [False]  # set while `tune_deferred` runs
YIELDING_NICE = 10


@contextlib.contextmanager
def deferred():
    """Within: a key not tuned yet (here or on disk) whose caller can tune it later (tune.pick's `later`) runs its
    `tune.provisional_config` launch, and is queued for `tune_deferred`."""
    before = getattr(_DEFERRING, "on", False)
    _DEFERRING.on = True
    try:
        yield
    finally:
        _DEFERRING.on = before


def deferring() -> bool:
    return getattr(_DEFERRING, "on", False)


def queue(key, later: Callable[[], None]) -> None:
    """Queue `key` (once) with the call that tunes it."""
    _PENDING.setdefault(key, later)


def drop(key) -> None:
    """`key` is being tuned where it was asked for: off the queue."""
    _PENDING.pop(key, None)


def provisional(key) -> bool:
    """Did `key` get `tune.provisional_config` for now? Its caller must not keep the launch for replay."""
    return key in _PENDING


def pending_keys() -> list:
    return list(_PENDING)


def tune_deferred(stop: Callable[[], bool] = lambda: False) -> int:
    """Tune the queued keys, in the order they were queued, until none is left or `stop()` says so (asked
    before each key: a key's tuning is not cut short). Returns how many were tuned."""
    done = 0
    _YIELDING[0] = True
    try:
        while _PENDING and not stop():
            key = next(iter(_PENDING))
            later = _PENDING.pop(key)
            later()
            done += 1
    finally:
        _YIELDING[0] = False
    return done


def yielding() -> bool:
    return _YIELDING[0]


def yield_cpu() -> None:
    """Lower this thread's priority (and that of the processes it starts) to `YIELDING_NICE`; a thread already
    lower, or a system without per-thread priorities, stays as it is."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < YIELDING_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, YIELDING_NICE)
