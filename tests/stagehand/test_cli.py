"""The `stagehand` command line: inspect, schedule, and usage errors (exit 2, one line)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import torch

from torch_stagehand.app import telemetry_plots
from torch_stagehand.app.cli import UsageError, check_precision_range, main, parse_precision, prepare_training
from torch_stagehand.app.usage import user_errors


def test_parse_precision_maps():
    assert parse_precision("int8") == "int8"
    assert check_precision_range(parse_precision("0-2:int8,4:bf16"), 5) == {0: "int8", 1: "int8", 2: "int8",
                                                                            3: "bf16", 4: "bf16"}
    for bad, why in [("0-2:fp4", "unknown precision 'fp4'"), ("3-1:int8", "ascending"), ("a:int8", "index"),
                     ("0:int8,0:bf16", "a second time"),
                     ("2-5:int8,0-3:bf16", "'0-3:bf16' names block 2 a second time"),
                     ("int4", "unknown precision"), ("0:int8,", "empty part")]:
        with pytest.raises(UsageError, match=why):
            parse_precision(bad)


def test_train_without_peft_enables_grad_on_the_float_inputs(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    model = torch.nn.Linear(4, 4)
    inputs = {"x": torch.randn(2, 4), "ids": torch.arange(3), "pair": (torch.randn(1), 7)}
    model, got, how = prepare_training(model, inputs)
    assert "peft not installed" in how and not any(p.requires_grad for p in model.parameters())
    assert got["x"].requires_grad and got["pair"][0].requires_grad and got["pair"][1] == 7
    assert not got["ids"].requires_grad and not inputs["x"].requires_grad  # integers untouched; the caller's tensors too


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


@pytest.mark.parametrize("argv, message, before_build", [
    (["schedule", "tiny-bert", "--device", "cpu"], "unknown target 'tiny-bert'", True),
    (["schedule", "tiny-llama", "--device", "cpu", "--precision", "0:fp4"], "unknown precision 'fp4'", True),
    (["schedule", "nofile.py:build", "--device", "cpu"], "no file", True),
    (["schedule", "tiny-llama", "--device", "cpu", "--precision", "9:int8"], r"block\(s\) \[9\]", False),
    (["inspect", "tiny-llama", "--device", "cpu", "--graph", "nothing-like-this"], "matches none", False),
    # A bare number is refused before anything is built: 20 bytes is never what was meant.
    (["schedule", "tiny-llama", "--device", "cpu", "--vram-budget", "20"],
     r"--vram-budget: '20' has no unit; write .*'20GiB'.*'20GB'", True),
    # Library errors for what was asked (issue 29: fp8 on the CPU ended in a 30-line traceback).
    (["schedule", "tiny-llama", "--device", "cpu", "--precision", "fp8"],
     r"precision 'fp8' needs FP8 tensor cores.*fp8_emulate", False),
    (["schedule", "tiny-llama", "--device", "cpu", "--config",
      '{"selective_precision": {"mode": "static", "force_int8_blocks": [9]}}'], "block 9 does not exist", False),
    (["schedule", "tiny-llama", "--device", "cpu", "--config", '{"telemetry_file": "/no/such/folder/t.jsonl"}'],
     r"telemetry_file: .*its folder '/no/such/folder' does not exist", False),
])
def test_usage_errors_exit_2_with_one_line(argv, message, before_build, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    if before_build:
        assert len(err) == 1  # nothing else printed
    else:
        assert all(" ... " in line for line in err[:-1])  # only the progress lines of the stages that ran
    assert err[-1].startswith(f"stagehand {argv[0]}: error: ") and re.search(message, err[-1])
    assert "Traceback" not in "\n".join(err)


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "torch_stagehand.app.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "inspect" in result.stdout and "demo" in result.stdout


FACTORY = """
import torch, torch.nn as nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

def build():
    torch.manual_seed(0)
    return Net(), (torch.randn(2, 8),)

def broken():
    raise RuntimeError("no weights here")
"""


def test_file_factory_target_schedule_with_train(tmp_path, capsys):
    path = tmp_path / "mymodel.py"
    path.write_text(FACTORY)
    assert main(["schedule", f"{path}:build", "--device", "cpu", "--precision", "1:int8", "--train"]) == 0
    text = capsys.readouterr().out
    assert "blocks.2" in text and "backward" in text and "3 blocks" in text
    assert main(["schedule", f"{path}:broken", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"stagehand schedule: error: target '{path}:broken': RuntimeError: no weights here"]


def test_bad_config_and_bad_options_exit_2(capsys):
    assert main(["schedule", "tiny-llama", "--device", "cpu", "--config", '{"slots": 0}']) == 2
    assert "slots: must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["schedule", "tiny-llama", "--device", "tpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice: 'tpu'" in err[0]


def test_bad_arguments_from_the_console_script_print_one_line():
    result = subprocess.run([sys.executable, "-m", "torch_stagehand.app.cli", "schedule", "tiny-llama",
                             "--precision", "0-x:int8"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "stagehand schedule: error: --precision '0-x:int8': part '0-x:int8': "
        "blocks must be an index (4) or a range (0-3), got '0-x'"
    ]


def _run_cli(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "torch_stagehand.app.cli", *argv], capture_output=True, text=True,
                          cwd=cwd)


def _one_line_exit_2(result, *expected):
    lines = [line for line in result.stderr.strip().splitlines() if " ... " not in line]  # progress lines aside
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in expected:
        assert word in lines[0], lines[0]
    return lines[0]


def test_a_huge_precision_range_is_refused_before_it_is_expanded():
    # Expanded first, this range is a dict of 1e11 entries: the process was killed for memory.
    # The limit makes an expansion fail fast instead of swapping the machine.
    result = subprocess.run(
        [sys.executable, "-c", "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
         "from torch_stagehand.app.cli import main; sys.exit(main(sys.argv[1:]))",
         "schedule", "tiny-llama", "--device", "cpu", "--precision", "0-99999999999:int8"],
        capture_output=True, text=True, timeout=300)
    _one_line_exit_2(result, "blocks 0-99999999999", "block 4 does not exist", "0..3")
    with pytest.raises(UsageError, match="names block 5 a second time"):
        parse_precision("0-99999999999:int8,5:bf16")  # overlaps found from the ends, not by listing blocks


def test_config_and_json_that_are_folders_exit_2(tmp_path):
    _one_line_exit_2(_run_cli("schedule", "tiny-llama", "--device", "cpu", "--config", str(tmp_path)),
                     "--config", "is a directory")
    _one_line_exit_2(_run_cli("schedule", "tiny-llama", "--device", "cpu", "--json", str(tmp_path)),
                     "--json", "is a directory")
    a_file = tmp_path / "plain.txt"
    a_file.write_text("x")
    _one_line_exit_2(_run_cli("schedule", "tiny-llama", "--device", "cpu", "--json", str(a_file / "rows.json")),
                     "is a file, not a folder")
    assert a_file.read_text() == "x"


def test_demo_out_that_is_a_file_exits_2(tmp_path):
    a_file = tmp_path / "out.txt"
    a_file.write_text("keep me")
    _one_line_exit_2(_run_cli("demo", "--device", "cpu", "--out", str(a_file), "--steps", "1"), "--out", "is a file")
    assert a_file.read_text() == "keep me"


def test_bad_target_paths_exit_2(tmp_path):
    _one_line_exit_2(_run_cli("schedule", f"{tmp_path}:build", "--device", "cpu"), "no file")
    _one_line_exit_2(_run_cli("schedule", f"{tmp_path / 'missing.py'}:build", "--device", "cpu"), "no file")


FAILING_FORWARD = FACTORY.replace("return x + self.down(torch.relu(self.up(x)))",
                                  "raise ValueError('forward is broken')")


def test_a_factory_whose_forward_fails_is_one_line_and_debug_shows_the_traceback(tmp_path):
    path = tmp_path / "badforward.py"
    path.write_text(FAILING_FORWARD)
    line = _one_line_exit_2(_run_cli("schedule", f"{path}:build", "--device", "cpu"))
    assert f"target '{path}:build'" in line and "forward failed" in line and "forward is broken" in line
    debug = _run_cli("schedule", f"{path}:build", "--device", "cpu", "--debug")
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "forward is broken" in debug.stderr


def test_schedule_with_a_vram_budget_prints_and_writes_the_plan(tmp_path, capsys):
    out, png = tmp_path / "schedule.json", tmp_path / "timeline.png"
    assert main(["schedule", "tiny-llama", "--device", "cpu", "--vram-budget", "300KB", "--json", str(out),
                 "--timeline", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "planned plan:" in text and "H2D MiB this call" in text
    plan = json.loads(out.read_text())["plan"]
    assert plan["summary"].startswith("planned plan") and len(plan["blocks"]) == 4
    assert sum(b["resident"] for b in plan["blocks"]) >= 1
    assert main(["schedule", "tiny-llama", "--device", "cpu", "--vram-budget", "lots"]) == 2
    assert "stagehand schedule: error: --vram-budget: cannot read 'lots'" in capsys.readouterr().err


def test_a_plan_from_the_default_cost_model_says_so_in_the_table_and_the_json(tmp_path, capsys):
    out = tmp_path / "schedule.json"
    assert main(["schedule", "tiny-llama", "--device", "cpu", "--vram-budget", "300KB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ms (default cost model)" in text and "predicted ms (default cost model)" in text
    plan = json.loads(out.read_text())["plan"]
    assert plan["cost_model"] == "default" and "(default cost model)" in plan["summary"]


def test_the_demo_reports_a_precision_the_device_cannot_run_in_one_line(tmp_path):
    result = _run_cli("demo", "--device", "cpu", "--steps", "1", "--precision", "fp8", "--out", str(tmp_path / "o"))
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert err[-1].startswith("stagehand demo: error: precision 'fp8' needs FP8 tensor cores")


@pytest.mark.parametrize("error", user_errors(), ids=lambda cls: cls.__name__)
def test_every_library_user_error_is_one_line_and_exit_2(error, tmp_path, monkeypatch, capsys):
    def fails(*args, **kwargs):
        raise error("what was asked cannot be done\n  (the message's second line)")

    monkeypatch.setattr(telemetry_plots, "plot_telemetry", fails)
    assert main(["plot", str(tmp_path / "telemetry.jsonl")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "stagehand plot: error: what was asked cannot be done (the message's second line)"]


@pytest.mark.parametrize("bug", [ValueError, KeyError, RuntimeError, TypeError])
def test_a_bug_keeps_its_traceback(bug, tmp_path, monkeypatch):
    def fails(*args, **kwargs):
        raise bug("a bug in stagehand")

    monkeypatch.setattr(telemetry_plots, "plot_telemetry", fails)
    with pytest.raises(bug, match="a bug in stagehand"):  # not caught: the interpreter prints the traceback
        main(["plot", str(tmp_path / "telemetry.jsonl")])
