"""One way to write the files the runtime keeps between runs (compile bundles, cost models, bandwidths)."""

from __future__ import annotations

import contextlib
import os
import tempfile


def write_atomic(path: str, data: bytes | str) -> None:
    """Write `data` to `path` through a temporary file in the same folder and a rename: a reader, or a run
    killed mid-write, sees the old file or the new one, never half of one. Raises OSError (an unwritable
    folder, a full disk) with the temporary file removed; the caller decides what a lost write costs."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
