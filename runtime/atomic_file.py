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
        os.chmod(tmp, _mode_for(path))  # mkstemp makes it 0600: give it the mode `open(path, "w")` would
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _mode_for(path: str) -> int:
    """The file's own mode if it exists, else what a plain `open(path, "w")` creates (0666 less the umask)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
