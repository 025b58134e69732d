"""`stagehand.optim.HostAdamW`: AdamW on the host for streamed weights, stepped block by block as gradients land.

It must be AdamW exactly (equal to `torch.optim.AdamW` on an fp32 model, with
accumulation and clipping), step blocks during the backward (before `step()`
is called), keep its states fp32 through a checkpoint, round a bf16 weight
from an fp32 master (or stochastically, unbiased), refresh INT8 streams off
the hot path, and refuse a host too small for its states before allocating.
Its smaller moments (bf16, int8 codes) follow the fp32 ones, decode unbiased
and never to a zero second moment, and resume exactly from a checkpoint.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.optim import HostAdamW
from torch_stagehand.runtime.train.host import Hyper, Scratch, adamw_step, new_state, stochastic_round_

from _helpers import rel_err, toy

LR = 1e-2


def _model(n=3):
    model, x = toy(n=n)
    return model.requires_grad_(True), x


def _loss(forward, x, target):
    return (forward(x) - target).square().mean()


def _run_plain(model, x, target, steps, accumulation=1, clip=None):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        for _ in range(accumulation):
            loss = _loss(model, x, target)
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _steps(forward, x, target, opt, steps: int, accumulation: int = 1) -> list[float]:
    losses = []
    for _ in range(steps):
        for _ in range(accumulation):
            loss = _loss(forward, x, target)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run_host(model, forward, x, target, steps, accumulation=1, **kw):
    opt = HostAdamW(model.parameters(), lr=LR, accumulation_steps=accumulation, **kw)
    return _steps(forward, x, target, opt, steps, accumulation), opt


@pytest.mark.parametrize("compiled", [False, True, "recompute"], ids=["eager", "compiled", "recomputed blocks"])
@pytest.mark.parametrize("case", ["plain", "accumulate 2", "clip", "no overlap"])
def test_host_adamw_equals_torch_adamw(case, compiled):
    """`recomputed blocks`: each block's backward is a nested autograd pass of its own, still one backward."""
    kw, accumulation, clip = {}, 1, None
    if case == "accumulate 2":
        accumulation = 2
    elif case == "clip":
        clip = kw["max_grad_norm"] = 0.05
    elif case == "no overlap":
        kw["overlap"] = False
    model, x = _model()
    target = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    plain = copy.deepcopy(model)
    expected = _run_plain(plain, x, target, 4, accumulation, clip)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    try:
        torch._dynamo.reset()
        options = {"inner": "eager", **({"recompute": "blocks"} if compiled == "recompute" else {})}
        forward = torch.compile(model, backend="stagehand", options=options) if compiled else model
        losses, opt = _run_host(model, forward, x, target, 4, accumulation, **kw)
        assert losses == pytest.approx(expected, rel=1e-5)  # measured: within 1e-7 (fused vs for-loop AdamW)
        reference = dict(plain.named_parameters())
        for name, p in model.named_parameters():
            assert rel_err(p, reference[name]) < 1e-5, name  # measured: within 3e-7
        assert (opt.worker is not None) == (case in ("plain", "accumulate 2"))
    finally:
        rt.close()


def test_blocks_step_during_the_backward_before_step_is_called():
    model, x = _model(n=4)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    opt = HostAdamW(model.parameters(), lr=LR)
    before = [b.up.weight.detach().clone() for b in model.blocks]
    model(x).square().mean().backward()
    opt.worker.drain()  # wait for the worker, without stepping
    assert opt.worker.stepped == set(range(4))
    assert all(not torch.equal(b.up.weight, w) for b, w in zip(model.blocks, before))  # stepped already
    assert model.embed.weight.grad is not None  # resident parameters wait for step()
    embed = model.embed.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.embed.weight, embed)
    rt.close()


def test_a_step_cadence_that_does_not_match_accumulation_steps_is_an_error():
    model, x = _model()
    rt = stagehand.offload(model, device="cpu", verbose=False)
    opt = HostAdamW(model.parameters(), lr=LR)
    model(x).square().mean().backward()
    model(x).square().mean().backward()  # two backwards, accumulation_steps=1: the first already stepped
    with pytest.raises(RuntimeError, match="2 backward passes ran since the last step, but accumulation_steps=1"):
        opt.step()
    rt.close()


def test_a_bf16_weight_steps_from_its_fp32_master_and_rounds_to_nearest():
    torch.manual_seed(0)
    w = torch.randn(64, 32).to(torch.bfloat16)
    g = torch.randn(64, 32).to(torch.bfloat16)
    state = new_state(w, "fp32")
    ref = w.float().clone().requires_grad_(True)
    ref_opt = torch.optim.AdamW([ref], lr=LR)
    hyper = Hyper(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
    for _ in range(3):
        adamw_step([w], [g], [state], hyper, "fp32", (Scratch(), Scratch()))
        ref.grad = g.float()
        ref_opt.step()
    assert rel_err(state["master"], ref.detach()) < 1e-6  # the master is fp32 AdamW (measured 1e-8)
    assert torch.equal(w, state["master"].to(torch.bfloat16))  # the streamed weight is its rounding


@pytest.mark.parametrize("shared", [False, True], ids=["a value per element", "a step's shared noise"])
def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values(shared):
    from torch_stagehand.runtime.train.host import Noise

    gen = torch.Generator().manual_seed(0)
    src = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way from 1 to the next bf16 value (1 + 2**-7)
    dst = torch.empty_like(src, dtype=torch.bfloat16)
    stochastic_round_(dst, src, gen, noise=Noise(gen) if shared else None)
    up = (dst.float() > 1.0).float().mean().item()
    assert abs(up - 0.125) < 0.005  # rounds up 1/8 of the time: 2**-10 / 2**-7
    assert abs(dst.float().mean().item() - src[0].item()) < 2e-5
    exact = torch.randn(1000).to(torch.bfloat16).float()
    stochastic_round_(dst[:1000], exact, gen)
    assert torch.equal(dst[:1000].float(), exact)


def _square_steps(model, x, opt, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_checkpoint_and_resume_keep_fp32_states_of_bf16_weights(tmp_path):
    model, x = _model()
    model.to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    opt = HostAdamW(model.parameters(), lr=LR)
    _square_steps(model, x, opt, 2)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    after = _square_steps(model, x, opt, 2)
    rt.close()

    again, _ = _model()
    again.to(torch.bfloat16)
    saved = torch.load(tmp_path / "ckpt.pt")
    again.load_state_dict(saved["model"])
    rt2 = stagehand.offload(again, device="cpu", verbose=False)
    opt2 = HostAdamW(again.parameters(), lr=LR)
    opt2.load_state_dict(saved["opt"])
    streamed = [p for p in again.parameters() if p in opt2.state and "master" in opt2.state[p]]
    assert streamed and all(opt2.state[p]["exp_avg"].dtype == torch.float32 and
                            opt2.state[p]["master"].dtype == torch.float32 for p in streamed)
    assert _square_steps(again, x, opt2, 2) == after
    rt2.close()


def test_an_int8_stream_is_rebuilt_by_the_worker_after_its_block_steps():
    model, x = _model()
    rt = stagehand.offload(model, device="cpu", precision="int8", verbose=False)
    opt = HostAdamW(model.parameters(), lr=LR)
    model(x).square().mean().backward()
    opt.step()
    for block in range(len(rt.blocks)):  # fresh before any forward asks for it
        assert rt.store.blocks[block].source_versions["int8"] == rt.store.master_version(block)
    assert rt.store.requantized_blocks == len(rt.blocks)
    rt.close()


def test_a_host_too_small_for_the_states_is_refused_before_allocating(monkeypatch):
    from torch_stagehand.runtime.host import budget as host_budget
    from torch_stagehand.runtime.host.budget import MachineMemory
    from torch_stagehand.runtime.host.plan import HostMemoryError

    model, _ = _model()
    model.to(torch.bfloat16)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    monkeypatch.setattr(host_budget, "probe_machine", lambda: MachineMemory(total_bytes=2**30, available_bytes=1000))
    import torch_stagehand.runtime.train.optimizer as optim_module
    monkeypatch.setattr(optim_module, "probe_machine", host_budget.probe_machine)
    with pytest.raises(HostMemoryError, match=r"fp32 masters .*fp32 moments.*master='bf16'"):
        HostAdamW(model.parameters(), lr=LR)
    rt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32 weight", "bf16 weight, fp32 master"])
def test_a_step_in_chunks_equals_one_pass(dtype):
    """The chunks (cache-sized) each start from the same step count: the result is the whole tensor's step."""
    from torch_stagehand import config

    torch.manual_seed(0)
    weights = [torch.randn(37, 29).to(dtype), torch.randn(300).to(dtype)]
    grads = [torch.randn_like(w) for w in weights]
    hyper = Hyper(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
    results = []
    for chunk in (1 << 21, 100):
        ws = [w.clone() for w in weights]
        states = [new_state(w, "fp32") for w in ws]
        with config.patch(host_adamw_chunk=chunk):
            for _ in range(3):
                adamw_step(ws, grads, states, hyper, "fp32", (Scratch(), Scratch()))
        results.append((ws, states))
    (one, one_states), (chunked, chunked_states) = results
    for a, b, sa, sb in zip(one, chunked, one_states, chunked_states):
        assert sa["step"] == sb["step"] == 3
        # The kernel's vector body and scalar tail round a last bit differently: where a chunk ends moves
        # elements between them (measured 1 ulp on exp_avg_sq, the weights equal).
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-6, atol=0)


# ---- smaller moments: states="bf16" / "int8" ------------------------------------------------------------------


def _train(states: str, steps: int = 30, seed: int = 0):
    torch.manual_seed(0)
    model, x = _model()
    target = torch.randn_like(model(x)).detach()
    rt = stagehand.offload(model, device="cpu", verbose=False)
    losses, opt = _run_host(model, model, x, target, steps, states=states, seed=seed)
    return losses, model, opt, rt


@pytest.mark.parametrize("states, tol", [("bf16", 4e-3), ("int8", 2e-2)])
def test_smaller_moments_follow_fp32_adamw(states, tol):
    """30 steps of the toy model, every parameter (streamed and resident) with the smaller moments: every step's
    loss within tol of fp32 moments' (measured 2.2e-3 bf16, CPU, torch 2.13), and the moments take the bytes
    they say, the resident parameters' too."""
    reference, _, _, rt = _train("fp32")
    rt.close()
    losses, model, opt, rt = _train(states)
    assert max(abs(a - b) / b for a, b in zip(losses, reference)) < tol
    assert losses[-1] < 0.1 * losses[0]  # it trains
    from torch_stagehand.runtime.train.host import QBLOCK

    for p in opt._streamed + opt._resident:
        kept = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k.startswith("exp_avg"))
        # bf16: 2 + 2 bytes; int8: 1 + 1 bytes and an fp32 scale each per started block of QBLOCK
        assert kept == (4 * p.numel() if states == "bf16" else 2 * p.numel() + 8 * -(-p.numel() // QBLOCK))
    rt.close()


def test_int8_codes_are_unbiased_within_one_code_and_keep_a_nonzero_second_moment():
    from torch_stagehand.runtime.train.host import QBLOCK, Moments, Noise

    n = 5 * QBLOCK + 37  # a last block that is not whole
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(n, generator=gen) * torch.logspace(-4, 0, n)  # small and large values in one block
    v = m.square() * 3
    v[7] = 1e-30  # tiny but nonzero: must not decode to 0 (m / (sqrt(0) + eps) would be a huge step)
    state = new_state(torch.empty(n), "fp32", "int8")
    decoded_m = torch.zeros(n, dtype=torch.float64)
    draws = 200
    for _ in range(draws):
        moments = Moments(state, (Scratch(), Scratch()), Noise(gen))  # a step's noise: drawn again each step
        m32, v32 = moments.decode(0, n)
        m32.copy_(m)
        v32.copy_(v)
        moments.encode(0, n)
        dm, dv = moments.decode(0, n)
        scale_m = state["exp_avg_scale"].repeat_interleave(QBLOCK)[:n]
        assert ((dm - m).abs() <= scale_m * (1 + 1e-6)).all()  # within one code of its block
        assert (dv > 0).all() and dv[7] > 0
        decoded_m += dm.double()
    # unbiased: the mean of 200 stochastic roundings sits within a few standard errors of the value
    scale_m = state["exp_avg_scale"].repeat_interleave(QBLOCK)[:n].double()
    assert ((decoded_m / draws - m.double()).abs() <= 4 * scale_m / draws**0.5 + 1e-12).float().mean() > 0.99


def test_a_resumed_run_with_int8_moments_continues_exactly(tmp_path):
    _, model, opt, rt = _train("int8", steps=2)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    x = _model()[1]
    torch.manual_seed(1)
    target = torch.randn_like(model(x)).detach()
    after = _steps(model, x, target, opt, 3)
    rt.close()

    again, _ = _model()
    saved = torch.load(tmp_path / "ckpt.pt")
    again.load_state_dict(saved["model"])
    rt2 = stagehand.offload(again, device="cpu", verbose=False)
    opt2 = HostAdamW(again.parameters(), lr=LR, states="int8")
    opt2.load_state_dict(saved["opt"])
    assert all(opt2.state[p]["exp_avg"].dtype == torch.int8 for p in opt2._streamed)
    assert _steps(again, x, target, opt2, 3) == after  # the same codes, scales and random stream
    with pytest.raises(ValueError, match="saved moments of blocks.0.up.weight are int8, this optimizer keeps states='fp32'"):
        HostAdamW(again.parameters(), lr=LR, overlap=False).load_state_dict(saved["opt"])
    rt2.close()


def test_a_host_too_small_for_fp32_moments_is_told_of_int8_moments(monkeypatch):
    from torch_stagehand.runtime.host import budget as host_budget
    from torch_stagehand.runtime.host.budget import MachineMemory
    from torch_stagehand.runtime.host.plan import HostMemoryError
    import torch_stagehand.runtime.train.optimizer as optim_module

    model, _ = _model()
    rt = stagehand.offload(model, device="cpu", verbose=False)
    monkeypatch.setattr(optim_module, "probe_machine", lambda: MachineMemory(total_bytes=2**30, available_bytes=1000))
    with pytest.raises(HostMemoryError, match=r"fp32 moments .*states='int8' \(2 bytes a parameter"):
        HostAdamW(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=r"states must be one of \('fp32', 'bf16', 'int8'\), got 'int4'"):
        HostAdamW(model.parameters(), lr=LR, states="int4")
    rt.close()
