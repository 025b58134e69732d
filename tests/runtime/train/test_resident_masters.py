"""Full fine-tuning trains every parameter with a master: the streamed block weights and the resident ones alike.

The resident parameters (embeddings, the head, norms, the streamed Linears' biases) of a bf16 model used to
step in bf16 with bf16 moments and no master: at a full fine-tune's learning rate most of their updates
rounded away (a 3-layer Llama's embeddings moved 92% less than under an fp32-master AdamW). Here each
parameter's change over 12 steps at lr 2e-5 is compared with an fp32-master AdamW over the plain model
(`master="fp32"`), or with the same AdamW whose bf16 weights are their own master, rounded stochastically
(`master="bf16"`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import torch_stagehand as stagehand
from torch_stagehand.optim import HostAdamW
from torch_stagehand.runtime.train.host import stochastic_round_
from torch_stagehand.runtime.streamed import HostMasterParameter

LR, STEPS = 2e-5, 12
VOCAB = 256


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:  # Qwen2: q/k/v biases, the head tied to the embeddings
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    return model.to(torch.bfloat16).requires_grad_(True)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 24), generator=g) for _ in range(STEPS)]


def _reference(model, master: str) -> dict[str, torch.Tensor]:
    """AdamW in fp32 over the plain bf16 model: the fp32 masters it ends with (master="fp32"), or its bf16
    weights, each its own master, stepped in fp32 and rounded stochastically (master="bf16")."""
    model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in params.items()}
    opt = torch.optim.AdamW(masters.values(), lr=LR)
    g = torch.Generator().manual_seed(7)
    for ids in _batches():
        model(ids, labels=ids).loss.backward()
        for n, p in params.items():
            masters[n].grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for n, p in params.items():
                if master == "fp32":
                    p.copy_(masters[n])
                else:
                    stochastic_round_(p, masters[n].detach(), generator=g)
                    masters[n].copy_(p)  # the bf16 weight is the master
    return {n: (m.detach() if master == "fp32" else params[n].detach().float()) for n, m in masters.items()}


def _train(model, master: str, steps: range, opt_state: dict | None = None, device: str = "cpu", **kw):
    rt = stagehand.offload(model, device=device, verbose=False)
    opt = HostAdamW(model.parameters(), lr=LR, master=master, **kw)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    batches = [ids.to(device) for ids in _batches()]
    for i in steps:
        model(batches[i], labels=batches[i]).loss.backward()
        opt.step()
        opt.zero_grad()
    return rt, opt


def _trained(model, opt) -> dict[str, torch.Tensor]:
    """Each parameter's trained value: its fp32 master where it has one, else the weight itself."""
    return {n: (opt.state[p]["master"] if "master" in opt.state.get(p, {}) else p).detach().float().clone()
            for n, p in model.named_parameters()}


def _change_errors(initial, trained, reference) -> dict[str, float]:
    """Per parameter: |change - reference change| / |reference change|."""
    out = {}
    for n, ref in reference.items():
        expected, got = ref - initial[n], trained[n] - initial[n]
        out[n] = float((got - expected).norm() / expected.norm())
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2 tied"])
def test_every_parameter_follows_an_fp32_master_adamw(kind):
    model = _model(kind)
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    reference = _reference(model, "fp32")
    rt, opt = _train(model, "fp32", range(STEPS))
    try:
        resident = [n for n, p in model.named_parameters() if not isinstance(p, HostMasterParameter)]
        assert any("embed_tokens" in n for n in resident) and any("norm" in n for n in resident)
        if kind == "qwen2 tied":
            assert model.lm_head.weight is model.model.embed_tokens.weight
            assert any(n.endswith("k_proj.bias") for n in resident)
        for p in model.parameters():  # every parameter of a bf16 model keeps an fp32 master
            assert opt.state[p]["master"].dtype == torch.float32
            assert opt.state[p]["exp_avg"].dtype == torch.float32
        errors = _change_errors(initial, _trained(model, opt), reference)
        worst = max(errors, key=errors.get)
        assert errors[worst] < 0.25, f"{worst}: its change is {errors[worst]:.0%} off the fp32-master AdamW's"
        for n, p in model.named_parameters():  # the bf16 weight the model computes with is its master, rounded
            assert torch.equal(p.detach(), opt.state[p]["master"].to(torch.bfloat16)), n
    finally:
        rt.close()


def test_bf16_masters_round_stochastically_for_every_parameter():
    """master="bf16": no fp32 copy anywhere, and no update lost to rounding. Each element's rounding differs
    between two runs, so the measure is the change's projection on the fp32-master AdamW's change (1: on
    average, every update arrived; rounded to nearest, 0.18-0.27 here): the streamed and the resident
    parameters' within 0.25 of the stochastic-rounding reference's, over the parameters large enough for the
    projection to average (4096 elements and more)."""
    model = _model("llama")
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    exact, rounded = _reference(model, "fp32"), _reference(model, "bf16")
    rt, opt = _train(model, "bf16", range(STEPS))
    try:
        assert not any("master" in opt.state[p] for p in model.parameters())
        trained = _trained(model, opt)
        checked = []
        for n, ref in exact.items():
            direction = (ref - initial[n]).view(-1)
            if direction.numel() < 4096:
                continue
            projection = lambda values: float((values[n] - initial[n]).view(-1) @ direction / (direction @ direction))  # noqa: E731
            assert abs(projection(trained) - projection(rounded)) < 0.25, \
                f"{n}: {projection(trained):.2f} of the fp32 master's change, the reference {projection(rounded):.2f}"
            checked.append(n)
        assert "model.embed_tokens.weight" in checked and "lm_head.weight" in checked
        norms = [n for n in exact if "norm" in n]  # 64 ones each: a step of 2e-5 is 0.3% of a bf16 spacing
        assert any(not torch.equal(trained[n], initial[n]) for n in norms)  # rounded to nearest they never move
    finally:
        rt.close()


@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_a_resumed_run_continues_exactly(master, tmp_path):
    model = _model("qwen2 tied")
    whole = copy.deepcopy(model)
    rt, opt = _train(whole, master, range(STEPS))
    expected = {n: p.detach().clone() for n, p in whole.named_parameters()}
    rt.close()
    rt, opt = _train(model, master, range(STEPS // 2))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    rt.close()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    resumed = _model("qwen2 tied")
    resumed.load_state_dict(saved["model"])
    rt, opt = _train(resumed, master, range(STEPS // 2, STEPS), saved["opt"])
    try:
        for n, p in resumed.named_parameters():
            assert torch.equal(p.detach(), expected[n]), n
    finally:
        rt.close()


def test_clipping_scales_by_the_norm_of_every_gradient_resident_and_streamed():
    model = _model("llama")
    clip = 0.5
    ref = copy.deepcopy(model)
    ids = _batches()[0]
    ref(ids, labels=ids).loss.backward()
    total = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    rt = stagehand.offload(model, device="cpu", verbose=False)
    try:
        opt = HostAdamW(model.parameters(), lr=LR, max_grad_norm=clip)
        model(ids, labels=ids).loss.backward()
        assert opt._clip_scale() == pytest.approx(min(1.0, clip / float(total)), rel=1e-2)
    finally:
        rt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("place", ["device", "host", "host, after the backward"])
def test_on_a_gpu_the_resident_states_live_where_asked_and_train_alike(place):
    """resident_states="device": the masters and moments beside the parameters on the GPU; "host": page-locked
    on the host, each gradient copied down as it is final and stepped on the host during the backward, the
    weights copied up at step(); "host, after the backward" (overlap=False): all of it in step(). Each follows
    the fp32-master AdamW (computed on the CPU: the GPU's bf16 matmuls round differently, well inside it)."""
    model = _model("qwen2 tied")
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    reference = _reference(model, "fp32")
    kw = {"overlap": False} if place.endswith("after the backward") else {}
    rt, opt = _train(model, "fp32", range(STEPS), device="cuda", resident_states=place.split(",")[0], **kw)
    try:
        assert bool(opt.resident_lane._hooks) == (place == "host")
        for p in opt._resident:
            st = opt.state[p]
            assert p.device.type == "cuda"
            assert st["master"].device.type == ("cuda" if place == "device" else "cpu")
            assert int(st["step"]) == STEPS
            assert place == "device" or st["master"].is_pinned()
        errors = _change_errors(initial, {n: t.cpu() for n, t in _trained(model, opt).items()}, reference)
        # The keys' bias shifts every query's scores by the same amount, which softmax cancels: its gradient is
        # zero but for rounding, and its change is the rounding's (the GPU's and the CPU's differ).
        errors = {n: e for n, e in errors.items() if not n.endswith("k_proj.bias")}
        worst = max(errors, key=errors.get)
        assert errors[worst] < 0.25, f"{worst}: its change is {errors[worst]:.0%} off the fp32-master AdamW's"
        for p in opt._resident:  # the weight the GPU computes with is the master, rounded
            assert torch.equal(p.detach().cpu(), opt.state[p]["master"].cpu().to(torch.bfloat16))
    finally:
        rt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_update_auto_that_stays_on_the_host_warns_why():
    from torch_stagehand.optim import HostUpdateWarning

    model = _model("llama")
    rt = stagehand.offload(model, device="cuda", verbose=False)
    try:
        with pytest.warns(HostUpdateWarning, match="max_grad_norm"):
            HostAdamW(model.parameters(), lr=LR, max_grad_norm=1.0)
    finally:
        rt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("place", ["device", "host"])
def test_a_bf16_master_written_after_the_optimizer_was_built_steps_from_its_new_value(place):
    """master="bf16": the weight is its own master. Written after the optimizer was built (a checkpoint loaded
    into the model, an edit by hand), the next step starts from the new value, wherever the states live (the
    host's page-locked copy of it is refreshed before it steps)."""
    model = _model("llama")
    rt = stagehand.offload(model, device="cuda", verbose=False)
    try:
        opt = HostAdamW(model.parameters(), lr=0.0, weight_decay=0.0, master="bf16", resident_states=place)
        embed = model.model.embed_tokens.weight
        with torch.no_grad():
            embed.add_(1.0)
        written = embed.detach().clone()
        ids = _batches()[0].cuda()
        model(ids, labels=ids).loss.backward()
        opt.step()
        assert torch.equal(embed.detach(), written)  # lr 0: the step leaves the new value as it is
    finally:
        rt.close()


def test_a_model_that_was_never_offloaded_steps_with_masters_too():
    """No streamed weight (nothing offloaded): every parameter is resident and still gets its fp32 master."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).to(torch.bfloat16)
    opt = HostAdamW(model.parameters(), lr=LR)
    assert opt.runtime is None and opt.device_update_note == "no streamed weight"
    before = model.weight.detach().float().clone()
    model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    master = opt.state[model.weight]["master"]
    assert master.dtype == torch.float32 and not torch.equal(master, before)
    assert torch.equal(model.weight.detach(), master.to(torch.bfloat16))
