"""The selective-precision JSONL (selective-precision.txt's fields, plus what issue 10 measures).

One record per policy update: step_id, timestamp, blocks_bf16 / blocks_int8 /
blocks_fp8, mean / max / min_sensitivity, precision_changes,
estimated_bandwidth_saving_pct (from the host store's bytes per block of the
map in force vs all-bf16), measured_bandwidth_saving_pct (the runtime's H2D
byte counter over the interval that just ended, per step, vs the same counter
per step over the first interval scaled to all-bf16), and block_details.
"""

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
