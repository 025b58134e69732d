"""Progress for the slow stages of the command line (build, offload, first compile)."""

from __future__ import annotations

import sys
import threading
import time


class Stage:
    """`label ... 12s` on stderr while a slow stage runs (a live counter on a terminal)."""

    def __init__(self, label: str, stream=None):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seconds = 0.0

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self.stream.write(f"\r{self.label} ... {time.perf_counter() - self._start:.0f}s")
            self.stream.flush()

    def __enter__(self) -> "Stage":
        self._start = time.perf_counter()
        self.stream.write(f"{self.label} ...")
        self.stream.flush()
        if getattr(self.stream, "isatty", lambda: False)():
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.seconds = time.perf_counter() - self._start
        end = f"done in {self.seconds:.1f}s" if exc_type is None else "failed"
        prefix = f"\r{self.label} ... " if self._thread is not None else " "
        self.stream.write(f"{prefix}{end}\n")
        self.stream.flush()
