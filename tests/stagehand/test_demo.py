"""`stagehand demo`: a short run trains, streams, and writes its files."""

from __future__ import annotations

import json

from torch_stagehand.app import demo


def test_short_demo_trains_and_writes_plot_and_telemetry(tmp_path):
    # A smaller batch than the command's default: the compile dominates this test's time either way.
    result = demo.run(steps=12, device="cpu", out=str(tmp_path), progress=False, log=lambda _: None, batch=4, seq=64)
    first, last = result.loss_drop()
    assert last < first  # the loss goes down
    assert result.h2d_bytes > 0 and result.tokens_per_s > 0
    assert set(result.precision.values()) == {"bf16", "int8"}  # a mixed map
    png = (tmp_path / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    records = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert len(records) == 12 and [r["step_id"] for r in records] == list(range(12))  # explain's forward is not a step
    assert all(r["h2d_bytes"] > 0 and "forward" in r["phase_durations"] for r in records)
    schedule = (tmp_path / "schedule.txt").read_text()
    assert "prefetch" in schedule and "backward" in schedule  # explain() ran with grad: the backward schedule too
    assert json.loads((tmp_path / "summary.json").read_text())["losses"] == result.losses
    # The map changes during the run (all int8 from step 4, swapped from step 8): the heatmap is not flat.
    maps = [r["precision"] for r in records]
    assert maps[0] != maps[4] != maps[8] and set(maps[4].values()) == {"int8"}
    assert records[5]["h2d_bytes"] < records[1]["h2d_bytes"]  # INT8 blocks cross at about half the bytes

    # `stagehand plot` draws the demo's telemetry.
    from torch_stagehand.app.cli import main

    assert main(["plot", str(tmp_path / "telemetry.jsonl"), "--out", str(tmp_path / "plots")]) == 0
    for name in ("timeline", "memory", "precision"):
        png = (tmp_path / "plots" / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name


def test_demo_command_usage_errors_exit_2(capsys):
    from torch_stagehand.app.cli import main

    assert main(["demo", "--device", "cpu", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    assert main(["demo", "--device", "cpu", "--precision", "0-9:int8"]) == 2
    assert "the model has blocks 0..3" in capsys.readouterr().err
