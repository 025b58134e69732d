"""Selective precision acting on a real peft-LoRA transformers model, compiled (inner "eager").

The user's loop is unchanged (forward, backward, optimizer.step); `rt.attach(optimizer)`
runs the policy. A new map reaches the next step without a Dynamo recompile, and a map
seen before compiles nothing.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.config import Config
from _helpers import lora_llama, sp_config, train_sgd

peft = pytest.importorskip("peft")


class Records(logging.Handler):
    """The selective-precision logger's records (works with or without pytest's logging plugin)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        logger = logging.getLogger("torch_stagehand.selective_precision")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logger = logging.getLogger("torch_stagehand.selective_precision")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def test_the_policy_changes_the_map_during_training_with_no_dynamo_recompile(tmp_path):
    model, inputs = lora_llama()
    rt = stagehand.offload(model, device="cpu", config=sp_config(tmp_path))
    assert rt.selective is not None and set(rt.precision.values()) == {"bf16"}
    torch._dynamo.reset()
    with Records() as caplog:
        compiled, opt, losses = train_sgd(model, inputs, rt, steps=1)
        graphs = len(rt.graph_records)
        train_more = lambda n: [compiled(**inputs, labels=inputs["input_ids"]).loss.backward() or opt.step()
                                or opt.zero_grad() for _ in range(n)]
        train_more(1)  # step 2: the first update, applied before the optimizer step
    changed = {b: p for b, p in rt.precision.items() if p != "bf16"}
    assert changed and set(changed.values()) == {"int8"}
    assert len(caplog.records) == len(rt.selective.changes) >= len(changed)
    assert all("bf16 -> int8" in r.getMessage() for r in caplog.records)
    h2d = rt.stats()["h2d_bytes"]
    train_more(1)  # step 3 runs the new map
    int8_step = rt.stats()["h2d_bytes"] - h2d
    assert len(rt.graph_records) == graphs  # no Dynamo recompile for a new map
    assert rt.stats()["compiled_variants"] >= 2  # int8 block variants compiled once, re-linked after
    train_more(3)
    records = [json.loads(line) for line in (tmp_path / "sp.jsonl").read_text().splitlines()]
    assert [r["step_id"] for r in records] == [2, 4, 6]
    for key in ("timestamp", "blocks_bf16", "blocks_int8", "mean_sensitivity", "max_sensitivity",
                "min_sensitivity", "precision_changes", "estimated_bandwidth_saving_pct", "block_details",
                "measured_bandwidth_saving_pct"):
        assert key in records[-1], key
    assert records[0]["measured_bandwidth_saving_pct"] == 0.0  # the first interval ran all bf16
    # Later intervals ran int8 blocks: fewer bytes per step, measured by the transfer counters.
    assert records[-1]["measured_bandwidth_saving_pct"] > 0 and records[-1]["estimated_bandwidth_saving_pct"] > 0
    assert records[-1]["h2d_bytes_per_step"] == pytest.approx(int8_step, rel=0.35)
    # Back to a map seen before: nothing compiles.
    before = rt.stats()["compiled_variants"]
    rt.set_precision("bf16")
    train_more(1)
    assert rt.stats()["compiled_variants"] == before and len(rt.graph_records) == graphs
    assert rt.selective.stats.host_reads == 3  # once per update (steps 2, 4, 6), never per step


def test_a_plain_precision_without_a_mode_stays_exactly_as_given(tmp_path):
    model, inputs = lora_llama()
    rt = stagehand.offload(model, device="cpu", precision={1: "int8"})
    assert rt.selective is None
    torch._dynamo.reset()
    train_sgd(model, inputs, rt, steps=4)
    assert rt.precision == {0: "bf16", 1: "int8", 2: "bf16", 3: "bf16"}


def test_enabled_false_turns_a_configured_mode_off(tmp_path):
    model, inputs = lora_llama()
    rt = stagehand.offload(model, device="cpu", config=sp_config(tmp_path, enabled=False))
    assert rt.selective is None
    with pytest.raises(ValueError, match="selective_precision.enabled"):
        stagehand.offload(lora_llama()[0], device="cpu", precision="auto", config=sp_config(tmp_path, enabled=False))


def test_auto_runs_the_seed_defaults_and_a_mode_uses_precision_as_the_start(tmp_path):
    model, _ = lora_llama()
    rt = stagehand.offload(model, device="cpu", precision="auto")
    assert rt.selective.policy.mode == "dynamic" and rt.selective.cfg.warmup_steps == 10
    assert not rt.selective.policy.start_given  # "auto": ambiguous_default places the ambiguous blocks
    rt.restore()
    model, _ = lora_llama()
    rt = stagehand.offload(model, device="cpu", precision="int8",
                           config=Config.from_dict({"selective_precision": {"mode": "dynamic"}}))
    assert rt.selective.policy.start_given and rt.precision == {b: "int8" for b in range(4)}
    rt.restore()
    model, _ = lora_llama()
    rt = stagehand.offload(model, device="cpu", precision={2: "int8"},
                           config=Config.from_dict({"selective_precision": {"mode": "static", "force_bf16_blocks": [2],
                                                                            "force_int8_blocks": [0]}}))
    assert rt.precision == {0: "int8", 1: "bf16", 2: "bf16", 3: "bf16"}


def test_log_decisions_and_telemetry_enabled_false_silence_both(tmp_path):
    """Their true sides are asserted by the first test (a record per change, a JSONL per update)."""
    model, inputs = lora_llama()
    rt = stagehand.offload(model, device="cpu", config=sp_config(tmp_path, log_decisions=False,
                                                                 telemetry_enabled=False))
    torch._dynamo.reset()
    with Records() as caplog:
        train_sgd(model, inputs, rt, steps=2)
    assert rt.selective.changes  # the policy did switch blocks
    assert not [r for r in caplog.records if "->" in r.getMessage()]
    assert not (tmp_path / "sp.jsonl").exists()


def test_a_loss_spike_after_a_switch_reverts_it_and_keeps_the_block_in_bf16(tmp_path):
    model, inputs = lora_llama()
    rt = stagehand.offload(model, device="cpu", config=sp_config(tmp_path, loss_feedback_steps=4,
                                                                 loss_feedback_block_steps=50))
    torch._dynamo.reset()
    _, opt, _ = train_sgd(model, inputs, rt, steps=2, observe_loss=True)  # step 2: some blocks go int8
    switched = {b for b, p in rt.precision.items() if p == "int8"}
    assert switched
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    with Records() as caplog:
        for _ in range(2):  # steps 3, 4: the loss the policy sees jumps after the switch
            loss = compiled(**inputs, labels=inputs["input_ids"]).loss
            loss.backward()
            rt.observe_loss(loss * 3)
            opt.step()
            opt.zero_grad()
    assert all(rt.precision[b] == "bf16" for b in switched)
    assert any("loss spike" in r.getMessage() for r in caplog.records)
    assert all(rt.selective.policy.blocked_until[b] == 4 + 50 for b in switched)
