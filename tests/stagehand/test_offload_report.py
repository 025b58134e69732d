"""offload() says what it did, once: block lists found and skipped (with why), blocks per precision,
bytes per step, host bytes, seconds; the same in stats() and explain(); a line after the first step."""

from __future__ import annotations

import io
import types

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.app.presets import tiny_flux, tiny_llama
from torch_stagehand.offload_report import BlockListSkippedWarning


def test_auto_skipping_a_one_block_list_is_said_and_warned(capsys):
    model, inputs = tiny_flux(dtype=torch.float32, double=1, single=2)
    with pytest.warns(BlockListSkippedWarning, match="transformer_blocks: 1 block"):
        rt = stagehand.offload(model, device="cpu")
    err = capsys.readouterr().err
    assert err.count("stagehand offload:") == 1
    assert "single_transformer_blocks (2 blocks, streamed)" in err
    assert "transformer_blocks skipped: 1 block (FluxTransformerBlock); a block list needs at least 2" in err
    lists = {b["fqn"]: b for b in rt.stats()["offload"]["block_lists"]}
    assert lists["transformer_blocks"]["streamed"] is False and lists["single_transformer_blocks"]["streamed"]
    rt.restore()

    # Naming it streams it, and nothing is skipped.
    with _no_skip_warning():
        rt = stagehand.offload(model, device="cpu", blocks=["transformer_blocks.0", "single_transformer_blocks.0",
                                                            "single_transformer_blocks.1"])
    assert all(b["streamed"] for b in rt.stats()["offload"]["block_lists"])
    rt.restore()


class _no_skip_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self.log = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        assert not [w for w in self.log if issubclass(w.category, BlockListSkippedWarning)]


def test_summary_counts_bytes_per_precision_and_reaches_stats_and_explain(capsys):
    model, inputs = tiny_llama(dtype=torch.float32)
    model.requires_grad_(False)
    rt = stagehand.offload(model, device="cpu", precision={0: "int8"})
    summary = rt.stats()["offload"]
    n = summary["blocks"]
    assert summary["precision_blocks"] == {"int8": 1, "bf16": n - 1}
    assert summary["forward_bytes"] == sum(rt.block_nbytes(b, p) for b, p in rt.precision.items())
    assert summary["precision_bytes"]["int8"] < rt.block_nbytes(0, "bf16")  # INT8 + scales < the fp32 block
    assert summary["host_bytes"] == rt.store.host_bytes() and summary["seconds"]["total"] >= 0
    # offload's stages in order, each timed apart (where a slow offload spent its seconds)
    stages = list(summary["seconds"])
    assert stages[:3] == ["find blocks", "sources indexed, files opened, workers started", "host store planned"]
    assert stages.index("resident tensors to the device") < stages.index("device slots") < stages.index("total")
    assert sum(v for k, v in summary["seconds"].items() if k != "total") <= summary["seconds"]["total"] + 1e-3
    err = capsys.readouterr().err
    assert f"int8 1 block ({summary['precision_bytes']['int8'] / 1e6:,.1f} MB)" in err
    # the host line names each copy and where it is, as stats()["host"] does (not one word for all)
    kinds = rt.stats()["host"]["bytes_by_kind"]
    assert summary["host_by_kind"] == kinds and {"bf16 ram", "int8 ram"} <= set(kinds)
    assert f"{kinds['int8 ram'] / 1e6:,.1f} MB int8 ram" in err and "keep_full=" in err
    with torch.no_grad():
        report = stagehand.explain(model, **inputs) if isinstance(inputs, dict) else stagehand.explain(model, *inputs)
    assert report.offload == summary and "precision int8 x1" in str(report)
    rt.restore()


def test_quiet_offload_prints_nothing_and_first_step_line(capsys):
    torch._dynamo.reset()  # this test's compile is the first of its model's forward
    model, inputs = tiny_llama(dtype=torch.float32)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    assert capsys.readouterr().err == ""
    rt.restore()

    model, inputs = tiny_llama(dtype=torch.float32)
    model.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    rt = stagehand.offload(model, device="cpu")
    opt = torch.optim.SGD([model.lm_head.weight], lr=0.1)
    rt.attach(opt)
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    capsys.readouterr()
    for _ in range(2):
        out = compiled(**inputs) if isinstance(inputs, dict) else compiled(*inputs)
        logits = out.logits if hasattr(out, "logits") else out[0]
        logits.float().mean().backward()
        opt.step()
    err = capsys.readouterr().err
    assert err.count("stagehand: first step took") == 1 and "block variants" in err
    rt.restore()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("last_run, expect", [(8, "compiled 2 of ~8 units (1 block variants) in 3.0 s, ~9 s left"),
                                               (0, "compiled 2 units (1 block variants) in 3.0 s")])
def test_the_first_compiles_live_line_estimates_from_the_last_run(monkeypatch, last_run, expect):
    """On a terminal the first call counts its units; with the count the last run's compile bundle holds, it
    says how many to expect and the seconds left at this run's pace (2 units in 3 s, 6 to go: ~9 s)."""
    from torch_stagehand.offload_report import FirstCallProgress

    events = types.SimpleNamespace(compile_listeners=[], step_listeners=[])
    monkeypatch.setattr(FirstCallProgress, "_expected", lambda self: last_run)
    stream = _Tty()
    progress = FirstCallProgress(types.SimpleNamespace(events=events), stream=stream)
    progress.on_compile("graph", 0.0)
    progress.on_compile("unit", 1.0)
    progress.on_compile("block variant", 2.0)
    assert stream.getvalue().rsplit("\r", 1)[-1] == "  " + expect
