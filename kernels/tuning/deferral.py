"""W8A16 tuning put off, and done while the step waits for something else: under `deferred()` (a cold step's eager
forward) a new key runs `tune.provisional_config`, not kept for replay, and is queued to be tuned on stand-in
tensors by `tune_deferred` while the backward waits for a worker, its threads yielding the CPU (`yield_cpu`)."""

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
    """Within: a new key that can be tuned later (tune.pick's `later`) runs provisionally and is queued."""
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
    """Tune the queued keys in order until none is left or `stop()` (asked before each key); returns how many."""
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
    """Lower this thread's priority (and its child processes') to `YIELDING_NICE`, where it is higher."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < YIELDING_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, YIELDING_NICE)
