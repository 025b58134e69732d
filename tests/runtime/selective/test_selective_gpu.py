"""Selective precision on a GPU: the statistics path never syncs, and the policy acts in a compiled run."""

from __future__ import annotations

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.config import Config
from torch_stagehand.runtime.selective.grad_stats import BlockGradStats

pytestmark = pytest.mark.gpu


def test_collecting_gradient_statistics_never_syncs_the_device():
    params = [[torch.randn(64, 8, device="cuda", requires_grad=True) for _ in range(3)] for _ in range(6)]
    for block in params:
        for p in block:
            p.grad = torch.randn_like(p)
    stats = BlockGradStats(params, window=5, device=torch.device("cuda"))
    stats.collect()  # first call: the owner index and counts are copied to the device once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(25):
            stats.collect()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    window = stats.read()
    assert stats.host_reads == 1 and sum(window.rel_magnitude) == pytest.approx(6.0)


def test_the_policy_switches_blocks_in_a_compiled_lora_run_without_recompiling(tmp_path):
    peft = pytest.importorskip("peft")
    from torch_stagehand.app.presets import tiny_llama

    model, inputs = tiny_llama(layers=4, batch=2, seq=64)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"],
                                                       init_lora_weights=False))
    config = Config.from_dict({"selective_precision": {
        "mode": "dynamic", "warmup_steps": 2, "update_interval_steps": 2, "min_steps_between_switches": 0,
        "int8_threshold": 0.55, "bf16_threshold": 0.6, "hysteresis_margin": 0.0,
        "telemetry_file": str(tmp_path / "sp.jsonl")}})
    rt = stagehand.offload(model, device="cuda", config=config)
    inputs = {k: v.cuda() for k, v in inputs.items()}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rt.attach(opt)
    graphs = None
    for step in range(8):
        compiled(**inputs, labels=inputs["input_ids"]).loss.backward()
        opt.step()
        opt.zero_grad()
        graphs = graphs or len(rt.graph_records)
    assert any(p == "int8" for p in rt.precision.values())
    assert len(rt.graph_records) == graphs
    assert rt.selective.stats.host_reads == 4


def test_gradients_on_the_host_and_the_device_are_reduced_where_they_are():
    """Full fine-tuning lands the streamed weights' gradients on the host, beside device ones: each block's
    statistics are those of all its gradients (the quality bench's full-fine-tuning selective arm failed here:
    one foreach over tensors of two devices)."""
    torch.manual_seed(0)
    params = [[torch.randn(64, 8, device=d, requires_grad=True) for d in ("cpu", "cuda", "cpu")] for _ in range(4)]
    for block in params:
        for p in block:
            p.grad = torch.randn_like(p)
    mixed = BlockGradStats(params, window=2, device=torch.device("cuda"))  # as offload() names it: no index
    assert mixed.device == params[0][1].device
    mixed.collect()
    same = [[p.detach().cuda().requires_grad_(True) for p in block] for block in params]
    for block, moved in zip(params, same):
        for p, q in zip(block, moved):
            q.grad = p.grad.cuda()
    reference = BlockGradStats(same, window=2, device=torch.device("cuda"))
    reference.collect()
    torch.testing.assert_close(mixed.ring, reference.ring)
