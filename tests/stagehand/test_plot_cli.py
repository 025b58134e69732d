"""`stagehand plot` on hand-written telemetry (every field the runtime writes) and its errors; `--version`."""

from __future__ import annotations

import json

import pytest

from torch_stagehand.app.cli import main
from torch_stagehand.app.telemetry_plots import load_records


def _record(step, precision, vram=None):
    r = {"step_id": step, "phase_durations": {"forward": 0.02, "backward": 0.03, "optimizer": 0.001},
         "h2d_bytes": 2_000_000 if precision == "bf16" else 1_000_000, "fetches": 4, "prefetches": 4,
         "sync_fetches": int(step == 0), "hits": 1, "peak_streamed_bytes": 1_000_000, "host_rss_mb": 500.0 + step,
         "precision": {"0": precision, "1": "bf16"}}
    if vram is not None:
        r.update(vram_allocated_mb=vram, vram_peak_mb=vram + 10)
    return r


def test_plot_writes_three_pngs(tmp_path, capsys):
    path = tmp_path / "telemetry.jsonl"
    path.write_text("".join(json.dumps(_record(i, "bf16" if i < 3 else "int8", vram=100.0)) + "\n" for i in range(6)))
    assert main(["plot", str(path)]) == 0  # default --out: beside the file
    out = capsys.readouterr().out
    for name in ("timeline", "memory", "precision"):
        assert f"{tmp_path / name}.png" in out
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("content, message", [
    ("", "has no step records"),
    ('{"step_id": 0}\nnot json\n', ":2: not JSON"),
    ('{"h2d_bytes": 1}\n', ":1: not a telemetry step record"),
])
def test_plot_bad_files_are_usage_errors(tmp_path, capsys, content, message):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    assert main(["plot", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_plot_missing_file(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope.jsonl")]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_load_records_keeps_order(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(_record(i, "bf16")) for i in range(3)) + "\n\n")
    assert [r["step_id"] for r in load_records(str(path))] == [0, 1, 2]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("stagehand (torch-stagehand) 0.")


def test_a_torn_last_line_of_a_killed_run_is_skipped_with_a_warning(tmp_path):
    """Telemetry is appended a line at a time: a run killed mid-write leaves its last line cut short. That
    line (no newline, not JSON) is skipped and said; a bad line anywhere else is still an error."""
    path = tmp_path / "t.jsonl"
    whole = "".join(json.dumps(_record(i, "bf16")) + "\n" for i in range(2))
    path.write_text(whole + json.dumps(_record(2, "bf16"))[:17])
    with pytest.warns(UserWarning, match=":3: a torn last line"):
        assert [r["step_id"] for r in load_records(str(path))] == [0, 1]
