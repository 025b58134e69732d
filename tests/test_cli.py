"""The `stagehand` command line: inspect, schedule, and usage errors (exit 2, one line)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from torch_stagehand.cli import UsageError, main, parse_precision


def test_parse_precision_maps():
    assert parse_precision("int8") == "int8"
    assert parse_precision("0-2:int8,4:bf16") == {0: "int8", 1: "int8", 2: "int8", 4: "bf16"}
    for bad, why in [("0-2:fp4", "unknown precision 'fp4'"), ("3-1:int8", "ascending"), ("a:int8", "index"),
                     ("0:int8,0:bf16", "a second time"), ("int4", "unknown precision"), ("0:int8,", "empty part")]:
        with pytest.raises(UsageError, match=why):
            parse_precision(bad)


def test_schedule_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["schedule", "tiny-llama", "--device", "cpu", "--precision", "1:int8", "--train",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("phase", "prefetch", "wait", "evict", "backward", "model.layers.3", "int8"):
        assert word in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["block"] for r in rows if r["action"] == "wait"] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_inspect_prints_rewritten_graphs(capsys):
    assert main(["inspect", "tiny-gpt2", "--device", "cpu", "--graph", "block_variant"]) == 0
    text = capsys.readouterr().out
    assert "torch.ops.stagehand.wait" in text and "torch.ops.stagehand.linear" in text
    assert "==== block_variant" in text and "segment" in text


@pytest.mark.parametrize("argv, message", [
    (["schedule", "tiny-bert", "--device", "cpu"], "unknown target 'tiny-bert'"),
    (["schedule", "tiny-llama", "--device", "cpu", "--precision", "0:fp4"], "unknown precision 'fp4'"),
    (["schedule", "tiny-llama", "--device", "cpu", "--precision", "9:int8"], r"block\(s\) \[9\]"),
    (["schedule", "nofile.py:build", "--device", "cpu"], "no file"),
    (["inspect", "tiny-llama", "--device", "cpu", "--graph", "nothing-like-this"], "matches none"),
])
def test_usage_errors_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and pytest.importorskip("re").search(message, err[-1])
    assert "Traceback" not in "\n".join(err)


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "torch_stagehand.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "inspect" in result.stdout and "demo" in result.stdout
