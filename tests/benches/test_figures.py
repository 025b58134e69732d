"""The figures README.md and docs/ quote are the figures their files give (benches/figures.py).

A generated block (`<!-- figures:NAME -->` ... `<!-- /figures:NAME -->`) that differs from what its result files
give now, a block that names no figure or is never closed, a cited `benches/results/...` path that does not
exist, and a block that reads a run recording no commit and clean tree each fail here, naming the document and
the block; a measured figure typed into a document's prose fails naming the document and its line. `make figures`
rewrites the blocks."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
from _helpers import ROOT



@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("stagehand_bench_figures", ROOT / "benches" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def render(figures):
    return figures.Renderer()  # each figure made once for the whole module (the offload report compiles)


def test_every_quoted_figure_matches_its_files(figures, render):
    problems = figures.check(render=render)
    assert not problems, "figures that drifted from their files (python benches/figures.py --write):\n" + \
        "\n".join(map(str, problems))


def test_every_document_quotes_generated_figures(figures):
    """The README's measured summary and every results page hold generated blocks, not hand-typed tables; a results
    page whose runs recorded no commit says that they are to be re-run instead."""
    docs = {p.relative_to(ROOT).as_posix(): p.read_text() for p in figures.documents()}
    for doc in ("README.md", "docs/coming-from.md"):
        assert figures.BLOCK.search(docs[doc]), f"{doc} quotes no generated figure"
    for doc in (p for p in docs if p.startswith("docs/results/")):
        assert figures.BLOCK.search(docs[doc]) or "to be re-run" in docs[doc], \
            f"{doc} quotes no generated figure and says nothing is to be re-run"
    assert "figures:headline" in docs["README.md"] and "figures:offload_report" in docs["README.md"]


def _copy_of(doc: Path, tmp_path: Path) -> Path:
    """The document at the same place under a copy of the root, with the result files it cites beside it."""
    copy = tmp_path / doc.relative_to(ROOT)
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(doc, copy)
    (tmp_path / "benches").mkdir(exist_ok=True)
    if not (tmp_path / "benches" / "results").exists():
        (tmp_path / "benches" / "results").symlink_to(ROOT / "benches" / "results")
    return copy


def test_an_edited_figure_is_caught_and_named(figures, render, tmp_path):
    page = _copy_of(ROOT / "docs" / "results" / "budget-sweeps.md", tmp_path)
    text = page.read_text()
    block = figures.BLOCK.search(text)
    assert block and block.group("name") == "sweep_flux"
    body = block.group("body")
    row = next(line for line in body.splitlines() if line.startswith("| `vram_budget`"))
    cells = row.split(" | ")
    cells[1] = str(int(cells[1]) + 1)  # one more millisecond in the step-time column
    page.write_text(text.replace(row, " | ".join(cells), 1))

    problems = figures.check([page], root=tmp_path, render=render)
    assert [p.block for p in problems] == ["sweep_flux"], problems
    assert "docs/results/budget-sweeps.md" in str(problems[0]) and "differs" in problems[0].what

    assert figures.write([page], root=tmp_path, render=render) == ["docs/results/budget-sweeps.md: sweep_flux"]
    assert page.read_text() == text  # --write puts the file's figure back
    assert figures.check([page], root=tmp_path, render=render) == []


def test_a_figure_typed_into_prose_is_named_with_its_line(figures, render, tmp_path):
    page = _copy_of(ROOT / "docs" / "results" / "budget-sweeps.md", tmp_path)
    lines = page.read_text().splitlines(keepends=True)
    lines[2:2] = ["A streamed Flux runs 612 ms a step, 1.9x faster, with `vram_budget=\"16GiB\"` as you type it.\n",
                  "\n", "```bash\n", "python train.py    # 612 ms a step: code, not prose\n", "```\n", "\n"]
    page.write_text("".join(lines))

    problems = figures.check([page], root=tmp_path, render=render)
    assert [(p.doc, p.line) for p in problems] == [("docs/results/budget-sweeps.md", 3)] * 2, problems
    assert "'612 ms'" in problems[0].what and "'1.9x'" in problems[1].what
    assert str(problems[0]).startswith("docs/results/budget-sweeps.md:3: '612 ms' stands in the prose")


@pytest.mark.parametrize("text, found", [
    ("took 2.5-3.1 s, then 40 min", ["2.5-3.1 s", "40 min"]),
    ("11.9 GB at 1.7 GB/s; 75% of the reads; 0.53× the step", ["11.9 GB", "1.7 GB/s", "75%", "0.53×"]),
    ("Qwen2.5-7B on sm_90, bf16s, 48x3072, commit 3ec649d, 12 bytes a parameter, 4 heads", []),
])
def test_the_prose_figure_pattern(figures, text, found):
    assert [m.group(0) for m in figures.PROSE_FIGURE.finditer(text)] == found


def test_a_block_that_reads_a_run_without_its_commit_is_named(figures, tmp_path, monkeypatch):
    """A JSON without a 40-hex commit and a clean tree in its env, or a log without benches/device_run.sh's
    header, may not be quoted."""
    env = {"device": "NVIDIA H200", "torch": "2.11.0+cu130"}
    (tmp_path / "labelled.json").write_text(figures.json.dumps({"env": dict(env, commit="a" * 40, tree="clean")}))
    (tmp_path / "short_commit.json").write_text(figures.json.dumps({"env": dict(env, commit="3ec649d", tree="clean")}))
    (tmp_path / "dirty.json").write_text(figures.json.dumps({"env": dict(env, commit="a" * 40, tree="dirty")}))
    (tmp_path / "labelled_tests.log").write_text(f"# stage pytests | commit {'b' * 40} | clean tree | 2026-11-28 | H200\n")
    (tmp_path / "unlabelled_tests.log").write_text("7 passed in 64.12s\n")
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    assert figures.unrecorded("labelled.json") is None and figures.unrecorded("labelled_tests.log") is None
    assert "no 40-hex commit" in figures.unrecorded("short_commit.json")
    assert "'dirty'" in figures.unrecorded("dirty.json")
    assert "header" in figures.unrecorded("unlabelled_tests.log")
    assert figures.labelled_test_logs() == ("labelled_tests.log",)

    monkeypatch.setitem(figures.FIGURES, "two_runs", figures.Figure(lambda: "| a |\n", ("labelled.json", "dirty.json")))
    doc = tmp_path / "page.md"
    doc.write_text("<!-- figures:two_runs -->\n| a |\n<!-- /figures:two_runs -->\n")
    problems = figures.check([doc], root=tmp_path, render=figures.Renderer())
    assert [(p.block, p.what.split(",")[0]) for p in problems] == [("two_runs", "reads benches/results/dirty.json")]


def test_a_missing_result_file_an_unknown_block_and_an_unclosed_one_are_named(figures, render, tmp_path):
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir(parents=True)
    (tmp_path / "benches" / "results").mkdir(parents=True)
    doc.write_text("See `benches/results/gone.json`.\n\n<!-- figures:no_such_table -->\n| a |\n"
                   "<!-- /figures:no_such_table -->\n\n<!-- figures:sweep_qwen -->\n| 1 |\n")
    problems = figures.check([doc], root=tmp_path, render=render)
    text = "\n".join(map(str, problems))
    assert "cites benches/results/gone.json, which does not exist" in text
    assert "figures:no_such_table: no such figure" in text
    assert "figures:sweep_qwen: is never closed" in text


def test_a_figure_keeps_the_columns_a_newer_file_adds(figures, tmp_path, monkeypatch):
    """A budget sweep with an Inductor baseline, reserved peaks, first steps and a resident int8 row (what the
    bench now records) shows them; a column no row has is left out."""
    rows = [
        {"mode": "resident (eager)", "baseline": "eager", "step_ms": 800.0, "peak_gib": 24.0, "ckpt": True},
        {"mode": "resident (inductor)", "baseline": "inductor", "step_ms": 600.0, "peak_gib": 30.0,
         "peak_reserved_gib": 31.0, "first_step_s": 300.0, "ckpt": True},
        {"mode": "resident int8 (stagehand, budget 70 GiB)", "step_ms": 540.0, "peak_gib": 20.0,
         "peak_reserved_gib": 21.0, "first_step_s": 90.0, "first_step_peak_gib": 22.0, "resident": 57, "streamed": 0,
         "recomputed": 0, "vram_budget_gib": 70.0, "ckpt": True, "predicted_ms": 530.0, "pred_err": -0.019},
        {"mode": "budget 8.0 GiB", "step_ms": 660.0, "peak_gib": 7.9, "peak_reserved_gib": 8.0, "budget_gib": 8.0,
         "resident": 10, "streamed": 47, "recomputed": 57, "ckpt": True, "under_budget": True},
    ]
    (tmp_path / "budget_sweep_new.json").write_text(figures.json.dumps({
        "env": {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "commit": "a" * 40, "tree": "clean"},
        "model": "flux", "ckpt": True, "shape": {"image_tokens": 4096, "text_tokens": 512}, "rows": rows}))
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    out = figures.sweep("budget_sweep_new.json")
    header = next(line for line in out.splitlines() if line.startswith("| setting"))
    for column in ("x resident (inductor)", "x resident (eager)", "peak reserved GiB", "first step s",
                   "first step peak GiB"):
        assert column in header
    assert "first step reserved GiB" not in header and "D2H" not in header
    assert header.index("x resident (inductor)") < header.index("x resident (eager)")
    assert "| resident int8 (stagehand, budget 70 GiB) | 540 | 0.90 | 0.68 |" in out
    assert "NVIDIA H200, torch 2.11.0+cu130" in out and "commit aaaaaaaaaaaa (clean tree)" in out


def test_the_offload_report_compares_with_its_times_normalised(figures):
    a = "  took 2.40 s (find blocks 0.00 s)\nstagehand: first step took 1.2 s; 6 units in 2.5 s; 28 streamed"
    b = "  took 3.87 s (find blocks 0.01 s)\nstagehand: first step took 14.0 s; 6 units in 2.1 s; 28 streamed"
    assert figures.normalise_seconds(a) == figures.normalise_seconds(b)
    assert figures.normalise_seconds(a) != figures.normalise_seconds(a.replace("6 units", "7 units"))
