"""benches/soak.py in miniature on the CPU: every step recorded, every telemetry record present, the visits
compared with the same budget's last visit, restore() leaves nothing locked; --summarize rebuilds the table."""

from __future__ import annotations

import json
import sys
from _helpers import ROOT

BENCHES = str(ROOT / "benches")


def test_the_soak_in_miniature_records_every_step_and_compares_each_budgets_visits(tmp_path):
    sys.path.insert(0, BENCHES)
    try:
        import soak
    finally:
        sys.path.remove(BENCHES)
    args = ["--tiny", "--device", "cpu", "--steps", "24", "--every", "6", "--switch-every", "5",
            "--budgets", "1.0,0.4", "--out", str(tmp_path)]
    assert soak.main(args) == 0
    result = json.loads((tmp_path / "soak_tiny.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "soak_tiny.jsonl").read_text().splitlines()]
    assert "commit" in lines[0]["env"] and "tree" in lines[0]["env"]  # the steps say which code ran them
    rows = soak.read_steps(str(tmp_path / "soak_tiny.jsonl"))
    assert rows == lines[1:] and len(rows) == 24 == result["steps_run"] == result["telemetry_records"]
    assert result["telemetry_complete"] and result["losses_finite"]
    assert result["switches"] == 5 and result["restore"]["pinned_locked_bytes"] == 0
    visits = result["visits"]
    assert [v["budget_gib"] for v in visits] == [visits[0]["budget_gib"], visits[1]["budget_gib"]] * 2
    assert visits[0]["budget_gib"] > visits[1]["budget_gib"]
    assert "rss_growth_gb" not in visits[1] and "rss_growth_gb" in visits[2]  # the second visit of the first budget
    assert all(v["settled"] < v["steps"] for v in visits)  # the steps after a change are left out
    # The spread's suspects are recorded per step: the collector's time, and gc.freeze() from the second round.
    assert all("gc_ms" in r and "host_ms" in r for r in rows) and "gc_freeze" in rows[12]["events"]
    assert [v["gc_frozen"] for v in visits] == [False, False, True, True]
    (tmp_path / "soak_tiny.log").write_text("python=3.11 | torch=2.13.0+cpu | device=cpu\n")  # the run's header
    assert soak.main(args + ["--summarize", str(tmp_path / "soak_tiny.jsonl")]) == 0
    summary = json.loads((tmp_path / "soak_tiny.json").read_text())
    assert summary["cut_short"] and summary["visits"] == visits and summary["env"]["torch"] == "2.13.0+cpu"
