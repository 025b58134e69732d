"""Full fine-tuning of streamed weights: the same training as plain PyTorch, through the backend.

Every streamed weight requires grad (or a chosen part of them, beside LoRA);
each model is offloaded, compiled with the backend, and trained with the
user's own `torch.optim.AdamW` over `model.parameters()`; a deep copy trains
plainly with the same optimizer. The loss at every step and every weight after
training must be the same: fp32 models stream fp32, so the only difference is
the order of floating-point sums inside the grad-weight GEMM (measured: none on
the CPU). The host copy is the master the optimizer steps; INT8 streams of a
trainable weight are rebuilt from it after every update.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.app.presets import tiny_flux, tiny_llama
from torch_stagehand.kernels import quantize_per_row
from torch_stagehand.runtime import precision as precisions

from _helpers import first_tensor, rel_err, tiny_qwen2, toy

STEPS = 3


def _qwen2():
    model, inputs = tiny_qwen2()
    return model.float(), inputs


def _llama():
    return tiny_llama(dtype=torch.float32, layers=3, batch=2, seq=16)


def _flux():
    return tiny_flux(dtype=torch.float32)


def _lm_loss(forward, inputs):
    return forward(**inputs, labels=inputs["input_ids"]).loss


def _dit_loss(forward, inputs):
    return first_tensor(forward(**inputs)).square().mean()


MODELS = {"llama": (_llama, _lm_loss, "hf"), "qwen2": (_qwen2, _lm_loss, "hf"), "flux": (_flux, _dit_loss, "diffusers")}


def _trainable_toy(**kw):
    model, x = toy(**kw)
    return model.requires_grad_(True), x


def _train(model, forward, loss_fn, inputs, steps=STEPS, rt=None, lr=1e-3):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    if rt is not None:
        rt.attach(optimizer)
    losses = []
    for _ in range(steps):
        loss = loss_fn(forward, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def _offloaded_and_plain(model, loss_fn, inputs):
    """Train a plain deep copy, then the model offloaded and compiled: (runtime, losses, plain losses, copy)."""
    plain = copy.deepcopy(model)
    expected, _ = _train(plain, plain, loss_fn, inputs)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    try:
        losses, _ = _train(model, compiled, loss_fn, inputs, rt=rt)
    except BaseException:
        rt.close()
        raise
    return rt, losses, expected, plain


def _checkpointing(model, style):
    if style == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.enable_gradient_checkpointing()


@pytest.mark.parametrize("ckpt", [False, True], ids=["saved", "checkpointed"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_full_finetune_through_the_backend_equals_plain_training(kind, ckpt):
    build, loss_fn, style = MODELS[kind]
    model, inputs = build()
    model.train()
    if ckpt:
        _checkpointing(model, style)
    rt, losses, expected, plain = _offloaded_and_plain(model, loss_fn, inputs)
    try:
        assert rt.stats()["eager_linear_calls"] == 0, "every block ran compiled"
        assert rt.grads.grad_gemms == STEPS * len(rt.layers)
        assert losses == pytest.approx(expected, rel=1e-6)  # measured: equal (CPU, torch 2.13)
        trained, reference = model.state_dict(), plain.state_dict()
        assert trained.keys() == reference.keys()
        for name, value in reference.items():
            assert rel_err(trained[name], value) < 1e-6, name  # measured: 0
        untrained = build()[0].state_dict()
        assert all(not torch.equal(s.module.weight, untrained[s.fqn + ".weight"]) for s in rt.layers)  # all trained
    finally:
        rt.close()


def test_lora_on_attention_and_full_training_of_the_mlps_mix():
    """peft LoRA on the attention projections (their bases frozen), the MLPs' streamed weights and the norms
    trained in full: one step equals plain training of the same mix."""
    peft = pytest.importorskip("peft")
    model, inputs = _llama()
    model.requires_grad_(False)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, config)
    for name, p in model.named_parameters():
        if ".mlp." in name or "norm" in name:
            p.requires_grad_(True)
    rt, losses, expected, plain = _offloaded_and_plain(model, _lm_loss, inputs)
    try:
        training = [s.fqn for s in rt.layers if s.module.weight.requires_grad]
        assert training and all(".mlp." in f for f in training)
        assert rt.grads.grad_gemms == STEPS * len(training)
        assert losses == pytest.approx(expected, rel=1e-6)
        reference = plain.state_dict()
        for name, value in model.state_dict().items():
            assert rel_err(value, reference[name]) < 1e-6, name
    finally:
        rt.close()


def test_accumulated_gradients_add_as_pytorch_does():
    """Two backwards before a step (gradient accumulation): each streamed weight's .grad is the sum."""
    model, x = _trainable_toy(n=3)
    plain = copy.deepcopy(model)
    for m in (plain, model):
        if m is model:
            rt = stagehand.offload(model, device="cpu", verbose=False)
        m(x).square().mean().backward()
        m(x * 2).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0), name
    assert rt.grads.grad_gemms == 2 * len(rt.layers)
    rt.close()


def test_save_load_and_resume_continue_with_the_same_loss(tmp_path):
    """Train 2 steps, save the model's and the optimizer's state, train 2 more; a fresh model and optimizer
    loaded from the files and offloaded again take the same 2 steps with the same losses."""
    model, inputs = _llama()
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rt.attach(optimizer)

    def step(forward, opt):
        loss = _lm_loss(forward, inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    for _ in range(2):
        step(compiled, optimizer)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt")
    after = [step(compiled, optimizer) for _ in range(2)]
    rt.close()

    resumed, _ = _llama()
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(saved["model"])
    rt2 = stagehand.offload(resumed, device="cpu", verbose=False)
    torch._dynamo.reset()
    compiled2 = torch.compile(resumed, backend="stagehand", options={"inner": "eager"})
    optimizer2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    optimizer2.load_state_dict(saved["optimizer"])
    rt2.attach(optimizer2)
    assert [step(compiled2, optimizer2) for _ in range(2)] == pytest.approx(after, rel=1e-6)
    rt2.close()


def test_int8_stream_of_a_trainable_weight_is_requantized_from_the_master_after_every_update():
    """The master stays full precision and takes every update; the INT8 copy that streams is rebuilt from it
    before each fetch: over 40 steps it never drifts from quantize(master), and the loss follows the
    full-precision run's (straight-through: gradients computed on the dequantized weights)."""
    model, x = _trainable_toy(n=3)
    target = torch.randn_like(model(x)).detach()
    plain = copy.deepcopy(model)
    rt = stagehand.offload(model, device="cpu", precision="int8", verbose=False)
    opt, plain_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, plain))
    rt.attach(opt)
    losses, plain_losses = [], []
    for _ in range(40):
        for m, o, out in ((model, opt, losses), (plain, plain_opt, plain_losses)):
            loss = (m(x) - target).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
        model(x)  # a forward fetches every block: their int8 copies are rebuilt from the updated masters
        for block in range(len(rt.blocks)):
            for position, spec in enumerate(rt.store.blocks[block].layers):
                lay = rt.store.layout(block, "int8")[position]
                q, s = precisions.get("int8").views(rt.store.buffer(block, "int8"), lay)
                ref_q, ref_s = quantize_per_row(spec.module.weight.detach(), method=rt.config.quantizer)
                assert torch.equal(q, ref_q) and torch.equal(s, ref_s), spec.fqn
    assert rt.store.requantized_blocks >= 40 * len(rt.blocks) - len(rt.blocks)
    assert losses[-1] < 0.5 * losses[0]
    assert abs(losses[-1] - plain_losses[-1]) < 0.05 * plain_losses[0]
    rt.close()


def test_a_host_too_small_for_the_gradients_is_refused_before_anything_moves(monkeypatch):
    from torch_stagehand.runtime.host import budget as host_budget
    from torch_stagehand.runtime.host.budget import MachineMemory
    from torch_stagehand.runtime.host.plan import HostMemoryError

    model, _ = _trainable_toy(n=4, d=64)
    frozen = copy.deepcopy(model).requires_grad_(False)
    weights = dict(model.named_parameters())
    masters = sum(b.up.weight.numel() + b.down.weight.numel() for b in model.blocks) * 4
    # the weights in RAM now are moved into the store, not copied: only the gradient buffers are new bytes
    fake = MachineMemory(total_bytes=8 * 2**30, available_bytes=masters // 2)
    monkeypatch.setattr(host_budget, "probe_machine", lambda: fake)
    stagehand.offload(frozen, device="cpu", verbose=False).close()  # frozen: the masters fit
    with pytest.raises(HostMemoryError, match=r"grad ram.*freeze some streamed weights"):
        stagehand.offload(model, device="cpu", verbose=False)  # training: + a gradient buffer each
    assert all(dict(model.named_parameters())[k] is v for k, v in weights.items())


# ---- the plan under full fine-tuning -------------------------------------------------------------------

def _block_bytes(model) -> int:
    block = model.blocks[0]
    return sum(p.numel() * p.element_size() for p in (block.up.weight, block.down.weight))


@pytest.mark.parametrize("resident", ["some", "none"])
def test_resident_and_streamed_blocks_train_correctly_under_a_budget(resident):
    """A resident block's weights change every step: it is copied in again at the step's end (no stale copy
    computes the next forward), and the training equals plain training whatever the plan. (A training block
    saves no H2D by being resident, its master changes every step: the planner keeps only what fits beside
    the slots resident.)"""
    model, x = _trainable_toy(n=6)
    target = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    plain = copy.deepcopy(model)
    loss_fn = lambda forward, _: (forward(x) - target).square().mean()  # noqa: E731
    expected, _ = _train(plain, plain, loss_fn, None, steps=4)
    b = _block_bytes(model)
    rt = stagehand.offload(model, device="cpu", vram_budget={"some": 6 * b, "none": 2 * b}[resident], verbose=False)
    try:
        n_resident = len(rt.plan.resident)
        assert (n_resident > 0) == (resident == "some")
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
        losses, _ = _train(model, compiled, loss_fn, None, steps=4, rt=rt)
        assert losses == pytest.approx(expected, rel=1e-6)
        if n_resident:  # copied in again at each step's end, before the next forward asks for them
            assert all(slot.master_version == rt.store.master_version(block)
                       for block, slot in rt.pool.resident_slots.items())
            assert rt.pool.stats.stale_slots >= 4 * n_resident
    finally:
        rt.close()


def test_the_plan_predicts_the_gradient_copies_and_the_host_optimizer_lane():
    """Each block's gradients go home after its backward (D2H lane), the host optimizer steps it once they
    landed (one block at a time): the step ends when the optimizer lane does, not when the GPU does."""
    from torch_stagehand.runtime.conductor.costs import BlockCost
    from torch_stagehand.runtime.conductor.planner import simulate

    costs = [BlockCost(bytes=10**6, forward_s=0.1, backward_s=0.2, grad_bytes=10**9, optimizer_s=1.0)
             for _ in range(3)]
    lanes: list = []
    t, _, h2d = simulate(costs, resident={0}, recompute=set(), slots=2, h2d_bps=1e12, d2h_bps=1e10, lanes=lanes)
    optimizer = sorted((start, end, b) for lane, b, start, end in lanes if lane == "optimizer")
    d2h = {b: (start, end) for lane, b, start, end in lanes if lane == "d2h"}
    gpu_end = max(end for lane, _, _, end in lanes if lane == "compute")
    assert [b for *_, b in optimizer] == [2, 1, 0]  # backward order
    assert optimizer[0][0] == pytest.approx(d2h[2][1])  # starts when block 2's gradients landed
    assert t == pytest.approx(optimizer[-1][1]) and t == pytest.approx(d2h[2][1] + 3.0)
    assert t > gpu_end + 1.0
    assert h2d[0] >= 10**6  # a resident block that trains is fetched again (its master changed)
    frozen, _, frozen_h2d = simulate([BlockCost(bytes=10**6, forward_s=0.1, backward_s=0.2) for _ in range(3)],
                                     resident={0}, recompute=set(), slots=2, h2d_bps=1e12)
    assert frozen < 1.0 and frozen_h2d[0] == 0


def test_host_adamw_measures_each_blocks_step_for_the_planner():
    from torch_stagehand.optim import HostAdamW

    model, x = _trainable_toy(n=3)
    b = _block_bytes(model)
    rt = stagehand.offload(model, device="cpu", vram_budget=2 * b, verbose=False)
    try:
        opt = HostAdamW(model.parameters(), lr=1e-3)
        model(x).square().mean().backward()
        opt.step()
        assert sorted(rt.grads.optimizer_seconds) == [0, 1, 2]
        plan = rt.replan()
        assert [c.grad_bytes for c in plan.costs] == [b] * 3
        assert all(c.optimizer_s > 0 for c in plan.costs)
    finally:
        rt.close()
