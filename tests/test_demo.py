"""`stagehand demo`: a short run trains, streams, and writes its files."""

from __future__ import annotations

import json

from torch_stagehand import demo


def test_short_demo_trains_and_writes_plot_and_telemetry(tmp_path):
    result = demo.run(steps=16, device="cpu", out=str(tmp_path), progress=False, log=lambda _: None)
    first, last = result.loss_drop()
    assert last < first  # the loss goes down
    assert result.h2d_bytes > 0 and result.tokens_per_s > 0
    assert set(result.precision.values()) == {"bf16", "int8"}  # a mixed map
    png = (tmp_path / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    records = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert len(records) == 16 and [r["step_id"] for r in records] == list(range(16))
    assert all(r["h2d_bytes"] > 0 and "forward" in r["phase_durations"] for r in records)
    assert "prefetch" in (tmp_path / "schedule.txt").read_text()
