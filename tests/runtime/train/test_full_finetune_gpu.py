"""On a CUDA device: full fine-tuning through the backend with Inductor, the gradients landed over D2H.

Run on the device machine with `pytest -m gpu tests/runtime/train/test_full_finetune_gpu.py`; skipped without CUDA.
A Llama (transformers) and a toy stack train every parameter for a few steps with a VRAM budget (the
planner's calibration, resident and streamed blocks) and with the fixed two-slot plan, with torch's
AdamW and with HostAdamW (blocks stepped as their gradients land), against plain training on the GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.app.presets import tiny_llama
from torch_stagehand.optim import HostAdamW

from _helpers import rel_err, toy
from test_device_update import delayed_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 4


def _train(model, forward, x, target, optimizer, steps=STEPS):
    losses = []
    for _ in range(steps):
        loss = (forward(x) - target).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _offloaded_llama():
    """A 4-layer bf16 Llama offloaded to the GPU: (model, input ids on the GPU, its Runtime)."""
    model, inputs = tiny_llama(dtype=torch.bfloat16, layers=4, batch=2, seq=64)
    model.config.use_cache = False
    return model, inputs["input_ids"].cuda(), stagehand.offload(model, device="cuda", verbose=False)


def _compiled_llama_losses(model, ids, opt, steps=STEPS) -> list[float]:
    """Train the offloaded Llama `steps` steps through the backend with Inductor: its losses."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "inductor"})
    losses = []
    for _ in range(steps):
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", ["torch", "host", "host+device"])
@pytest.mark.parametrize("budget", [None, "4MiB"], ids=["two slots", "budget"])
def test_full_finetune_on_the_gpu_equals_plain_training(optimizer, budget):
    """"host": HostAdamW as it comes (device_update="auto": after the first step it may move blocks to the
    device); "host+device": blocks 0, 2, 4 forced onto the device (runtime/train/device.py), the others on
    the host, from the first step."""
    model, x = toy(d=256, n=6)
    model.requires_grad_(True)
    x = x.cuda().repeat(2, 32, 1)
    target = torch.randn(x.shape[0], x.shape[1], 8, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    plain = copy.deepcopy(model).cuda()
    expected = _train(plain, plain, x, target, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    base = torch.cuda.memory_allocated()
    vram = None if budget is None else base + 4 * 2**20 + 64 * 2**20
    rt = stagehand.offload(model, device="cuda", vram_budget=vram, verbose=False)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "torch" else HostAdamW(
            model.parameters(), lr=1e-3, device_update=[0, 2, 4] if optimizer == "host+device" else "auto")
        rt.attach(opt)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="stagehand", options={"inner": "inductor"})
        losses = _train(model, compiled, x, target, opt)
        assert losses == pytest.approx(expected, rel=1e-4)  # fp32 end to end; cuBLAS may sum in another order
        reference = dict(plain.named_parameters())
        for name, p in model.named_parameters():
            assert rel_err(p.detach().cpu(), reference[name].detach().cpu()) < 1e-4, name
        assert rt.grads.grad_gemms == STEPS * len(rt.layers)
        assert rt.stats()["eager_linear_calls"] == 0
        if optimizer != "torch":
            assert opt.blocks_stepped_in_backward == STEPS * len(rt.blocks)  # every block overlapped
        if optimizer == "host+device":
            assert opt.device.layers_updated == STEPS * sum(1 for s in rt.layers if s.block in (0, 2, 4))
            assert set(rt.grads.optimizer_seconds) == {1, 3, 5}  # the host stepped the others
    finally:
        rt.close()


@pytest.mark.parametrize("device_update", ["off", [1, 3]], ids=["host", "blocks 1 and 3 on the device"])
def test_llama_bf16_full_finetune_with_host_adamw_follows_plain_training(device_update):
    """bf16 weights, an fp32 master on the host: the loss follows plain bf16-weight training with an fp32
    master (torch AdamW on fp32 copies, rounded back each step) within bf16's rounding; with some blocks
    stepped on the device too (their master and moments streamed in and out)."""
    model, inputs = tiny_llama(dtype=torch.bfloat16, layers=4, batch=2, seq=64)
    model.config.use_cache = False
    ids = inputs["input_ids"].cuda()
    plain = copy.deepcopy(model).cuda()
    master = [p.detach().float().clone().requires_grad_(True) for p in plain.parameters()]
    plain_opt = torch.optim.AdamW(master, lr=1e-3)
    expected = []
    for _ in range(STEPS):
        loss = plain(input_ids=ids, labels=ids).loss
        loss.backward()
        for m, p in zip(master, plain.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        plain_opt.step()
        with torch.no_grad():
            for m, p in zip(master, plain.parameters()):
                p.copy_(m)
        expected.append(loss.item())
    rt = stagehand.offload(model, device="cuda", verbose=False)
    try:
        opt = HostAdamW(model.parameters(), lr=1e-3, device_update=device_update)
        losses = _compiled_llama_losses(model, ids, opt)
        assert losses == pytest.approx(expected, rel=2e-2)  # bf16 activations: different roundings per kernel
        assert losses[-1] < losses[0]
        if device_update != "off":  # the device blocks' weights are their masters' rounding, as on the host
            for spec in rt.layers:
                w = spec.module.weight
                assert torch.equal(w.detach(), opt.state[w]["master"].to(torch.bfloat16)), spec.fqn
    finally:
        rt.close()


def test_the_delayed_update_on_the_gpu_trains_streamed_weights_one_step_late():
    """DPU (runtime/train/delayed.py) with Inductor, D2H gradient landings and a second set of gradient
    buffers: the losses of plain training whose streamed weights step with the previous step's gradients."""
    model, x = toy(d=256, n=6)
    model.requires_grad_(True)
    x = x.cuda().repeat(2, 32, 1)
    plain = copy.deepcopy(model).cuda()
    rt = stagehand.offload(model, device="cuda", verbose=False)
    try:
        expected = delayed_reference(plain, x, STEPS, {f"{s.fqn}.weight" for s in rt.layers}, lr=1e-3)
        opt = HostAdamW(model.parameters(), lr=1e-3, delayed_update=True)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="stagehand", options={"inner": "inductor"})
        losses = []
        for _ in range(STEPS):
            loss = compiled(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses == pytest.approx(expected, rel=1e-4)  # fp32 end to end; cuBLAS may sum in another order
        assert opt.delayed.updates == STEPS
    finally:
        rt.close()


@pytest.mark.parametrize("master, states", [("bf16", "int8"), ("fp32", "int8"), ("bf16", "bf16")])
def test_blocks_stepped_on_the_device_in_low_precision_states_follow_the_host(master, states):
    """int8 / bf16 moments and a bf16 master, streamed to the GPU in their own format and stepped by the fused
    kernel (kernels/adamw.py) for blocks 1 and 3: the losses follow the run that steps every block on the host."""
    def run(device_update):
        model, ids, rt = _offloaded_llama()
        try:
            opt = HostAdamW(model.parameters(), lr=1e-3, master=master, states=states, device_update=device_update)
            losses = _compiled_llama_losses(model, ids, opt)
            device = [s for s in rt.layers if s.block in (1, 3)]
            if device_update != "off":
                assert opt.device_blocks == {1, 3}
                assert opt.device.layers_updated == STEPS * len(device)
                assert {opt.state[s.module.weight]["exp_avg"].dtype for s in device} == \
                    {torch.int8 if states == "int8" else torch.bfloat16}
            return losses
        finally:
            rt.close()

    host, device = run("off"), run([1, 3])
    assert device == pytest.approx(host, rel=3e-2)  # stochastic rounding's draws differ (CPU: within 1.4%)
    assert device[-1] < device[0]


def test_device_blocks_under_gradient_accumulation_follow_the_host():
    """accumulation_steps=2 with blocks 1 and 3 stepped on the device: the first backward's gradients land on the
    host, their sums go up with the states in the second; the losses follow the host-only run's."""
    def run(device_update):
        model, ids, rt = _offloaded_llama()
        try:
            opt = HostAdamW(model.parameters(), lr=1e-3, accumulation_steps=2, device_update=device_update)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="stagehand", options={"inner": "inductor"})
            losses = []
            for _ in range(STEPS):
                for half in ids.chunk(2):
                    loss = compiled(input_ids=half, labels=half).loss
                    loss.backward()
                    losses.append(loss.item())
                opt.step()
                opt.zero_grad()
            if device_update != "off":
                assert opt.device.layers_updated == STEPS * sum(1 for s in rt.layers if s.block in (1, 3))
            return losses
        finally:
            rt.close()

    assert run([1, 3]) == pytest.approx(run("off"), rel=2e-2)
