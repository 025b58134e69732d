"""The selective-precision JSONL: one record per policy update (the controller's `_write_telemetry` fields), each
with its timestamp."""

from __future__ import annotations

import json
import os
import time
from typing import Any


class PrecisionTelemetry:
    def __init__(self, path: str | None):
        self.path = path
        self._file = None
        if path is not None:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise FileNotFoundError(f"selective_precision.telemetry_file: folder {folder!r} does not exist")

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._file is None:
            self._file = open(self.path, "a")
        self._file.write(json.dumps(dict(record, timestamp=round(time.time(), 3))) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
