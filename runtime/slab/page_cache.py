"""The slab's pages asked of the kernel ahead of offload's reads: one `posix_fadvise(WILLNEED)` on a thread.

Why: offload's reader threads need the GIL between their reads (a few times per layer), and beside them the
calling thread imports the compiler (seconds of Python that hold the GIL). Driven by those threads alone, the
disk idles whenever they wait for the GIL: the reads beside the imports went at 1.35-1.52 GB/s against
1.54-1.85 alone (`benches/slab_reads.py`), and offload's reads took 1.33x the disk's own read of the file.
The kernel's readahead needs no GIL: one call, on a thread of its own, asks for the whole data range, and the
file streams into the page cache at the disk's speed whatever the readers wait for; the readers, going through
the file in its order (`loading.py`), copy what is there or wait on the read already under way for it.

Only where the machine has room for the file's pages beside the host store that is being filled: pages
evicted before a reader got to them would be read from the disk twice. Not on a platform without
`posix_fadvise` (nothing to ask).
"""

from __future__ import annotations

import os
import threading
import time

from torch_stagehand.runtime import host_budget


class KernelReadAhead:
    """The thread that asked the kernel for a file's range; `seconds` once the kernel took the whole request."""

    def __init__(self, path: str, begin: int, end: int):
        self.path, self.begin, self.end = path, begin, end
        self.seconds: float | None = None
        self.error: OSError | None = None
        # A daemon: an offload that fails (a slab of other weights) does not wait for the rest of the file.
        self.thread = threading.Thread(target=self._ask, name="stagehand-slab-pages", daemon=True)
        self.thread.start()

    def _ask(self) -> None:
        start = time.perf_counter()
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:  # returns once every read is queued: the disk's time, with the GIL released throughout
                os.posix_fadvise(fd, self.begin, self.end - self.begin, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        except OSError as e:  # the readers read the file themselves, as without this thread
            self.error = e
        self.seconds = time.perf_counter() - start


def ask_kernel_ahead(path: str, begin: int, end: int) -> tuple[KernelReadAhead | None, str]:
    """Start asking for `path`'s bytes [begin, end) when there is room for them twice (the page cache and the
    store the readers fill); returns (the request or None, why in a few words)."""
    if not hasattr(os, "posix_fadvise"):
        return None, "no posix_fadvise on this platform"
    room, need = host_budget.probe_machine().usable_bytes, 2 * (end - begin)
    if room < need:
        return None, f"{host_budget.gib(room)} available, {host_budget.gib(need)} needed for the file's pages beside the store"
    return KernelReadAhead(path, begin, end), f"{host_budget.gib(end - begin)} asked of the kernel"
