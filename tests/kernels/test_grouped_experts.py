"""One-byte expert stacks multiplied from their bytes: the grouped low-bit GEMM, its op, and the rewrite.

CPU: the Triton kernel under TRITON_INTERPRET=1 against float64 (tests/kernels/grouped_interp.py in a subprocess),
the op's gradient, the argument checks, and compiled int8 / fp8 MoE blocks whose grouped GEMMs the rewrite
turned into `stagehand::grouped_experts` against the dense rewrite (experts_math="dense"). GPU (`-m gpu`):
every autotuner candidate and fp8's rowwise tensor cores against the torch twin.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand import kernels
from torch_stagehand.kernels import grouped_lowbit_ref

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from grouped_interp import CASES  # noqa: E402  (data only)

import transformers  # noqa: E402
from _helpers import moe_config, moe_inputs, moe_lora


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def test_the_triton_kernel_matches_float64_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(HERE / "grouped_interp.py")], env=env, capture_output=True, text=True,
                          timeout=300)
    results = {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert proc.returncode == 0 and results.keys() == CASES.keys(), proc.stderr[-3000:]
    for name, r in results.items():
        assert r["finite"], name
        assert r["rel_err"] < 8e-3, (name, r["rel_err"])  # the bf16 output's rounding
        assert r["dequant_err"] < 1e-6, (name, r["dequant_err"])  # the dequantize candidate's own kernel (fp32)


def _stack(experts, rows, cols, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, rows, cols, generator=gen, dtype=torch.float64)
    scale = w.abs().amax(-1) / 127.0
    return (w / scale.unsqueeze(-1)).round().to(torch.int8), scale


@pytest.mark.parametrize("rows_are_out", [True, False])
def test_the_op_gradient_is_the_product_with_the_stack_transposed(rows_are_out):
    q, scale = _stack(4, 6, 5)
    offs = torch.tensor([2, 2, 7, 9], dtype=torch.int32)
    x = torch.randn(9, 5 if rows_are_out else 6, dtype=torch.float64, requires_grad=True)
    op = torch.ops.stagehand.grouped_experts
    assert torch.autograd.gradcheck(lambda x: op(x, q, scale, offs, rows_are_out), (x,))
    y = op(x, q, scale, offs, rows_are_out)
    assert torch.allclose(y, grouped_lowbit_ref(x, q, scale, offs, rows_are_out))


def test_arguments_that_disagree_are_refused_and_named():
    q, scale = _stack(3, 4, 5)
    offs = torch.tensor([1, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="x has 4 features.*reduces over 5"):
        kernels.grouped_lowbit(torch.randn(3, 4), q, scale.float(), offs, True)
    with pytest.raises(ValueError, match=r"one per stored row, \[3, 4\]"):
        kernels.grouped_lowbit(torch.randn(3, 5), q, scale.float()[:, :2], offs, True)
    with pytest.raises(ValueError, match="one end per expert"):
        kernels.grouped_lowbit(torch.randn(3, 5), q, scale.float(), offs[:2], True)


def _moe(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(family)).to(torch.bfloat16)
    model.requires_grad_(False)
    return model


def _train(model, precision, experts_math, calls):
    config = stagehand.Config()
    config.selective_precision.fp8_emulate = True  # no FP8 tensor cores here: fp8 computes as W8A16
    rt = stagehand.offload(model, device="cpu", precision=precision, config=config, verbose=False)
    ids = moe_inputs()
    saved = []
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager", "experts_math": experts_math})
    real = kernels.grouped_lowbit

    def counted(*args):
        calls.append(args[4])
        return real(*args)

    kernels.grouped_lowbit = counted
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = compiled(ids, labels=ids).loss
        loss.backward()
    finally:
        kernels.grouped_lowbit = real
    forbidden = {s.buf.untyped_storage().data_ptr() for s in rt.pool.slots}
    assert not [t for t in saved if t.untyped_storage().data_ptr() in forbidden]  # no weight crossed the turn
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, rt


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_compiled_blocks_multiply_one_byte_stacks_from_their_bytes_as_the_dense_rewrite(family, precision):
    base = moe_lora(_moe(family))
    base.train()
    dense_model = copy.deepcopy(base)
    grouped_calls, dense_calls = [], []
    loss, grads, rt = _train(base, precision, "grouped", grouped_calls)
    want_loss, want_grads, _ = _train(dense_model, precision, "dense", dense_calls)
    # Each block's two stacks: the forward's two products and the backward's two grad-inputs, the latter with
    # the stack's dimensions swapped (gpt-oss keeps its stacks [in, out]: the other way round).
    layers = len(rt.blocks)
    assert len(grouped_calls) == 4 * layers and not dense_calls
    forward_out = family != "gpt_oss"
    assert grouped_calls.count(forward_out) == 2 * layers and grouped_calls.count(not forward_out) == 2 * layers
    torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=2e-2)
    assert grads.keys() == want_grads.keys() and grads
    for name in grads:
        err = (grads[name].float() - want_grads[name].float()).norm() / want_grads[name].float().norm()
        assert err < 3e-2, (name, err.item())


def test_a_stack_with_an_adapter_on_it_is_made_dense_for_the_adapter():
    from test_moe import EXPERT_TARGETS
    import peft

    model = _moe("qwen3_moe")
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=[], target_parameters=EXPERT_TARGETS["qwen3_moe"],
                                                       init_lora_weights=False))
    model.train()
    calls = []
    _train(model, "int8", "grouped", calls)
    assert not calls  # the stack plus its low-rank delta is a dense stack: the model's GEMM reads it


def test_the_option_is_checked():
    from torch_stagehand.compiler.context import BackendOptions, BackendOptionsError

    assert BackendOptions.from_dict({"experts_math": "dense"}).experts_math == "dense"
    with pytest.raises(BackendOptionsError, match="experts_math"):
        BackendOptions.from_dict({"experts_math": "fast"})


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows_are_out", [True, False])
@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
def test_every_candidate_on_the_gpu_computes_the_torch_twin(rows_are_out, wdtype):
    from torch_stagehand.kernels import grouped
    from torch_stagehand.kernels.tuning import autotune as tune

    torch.manual_seed(0)
    experts, rows, cols = 16, 384, 256
    w = torch.randn(experts, rows, cols, device="cuda")
    scale = w.abs().amax(-1) / (127.0 if wdtype == torch.int8 else 448.0)
    q = (w / scale.unsqueeze(-1)).round().clamp(-127, 127).to(wdtype) if wdtype == torch.int8 else \
        (w / scale.unsqueeze(-1)).to(wdtype)
    counts = torch.randint(0, 200, (experts,), device="cuda")
    counts[3] = 0
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(offs[-1]), cols if rows_are_out else rows, device="cuda", dtype=torch.bfloat16)
    want = grouped_lowbit_ref(x, q, scale, offs, rows_are_out).float()
    for cfg in grouped._options(x.shape[0] // experts):
        if cfg.mode == "dequant":
            got = grouped.dequant_grouped_mm(x, q, scale, offs, rows_are_out)
        else:
            got = grouped.grouped_lowbit_triton(x, q, scale, offs, rows_are_out, grouped._tile_of(cfg))
        assert (got.float() - want).norm() / want.norm() < 1e-2, cfg
    chosen = kernels.grouped_lowbit(x, q, scale, offs, rows_are_out)
    tol = 8e-2 if grouped.has_scaled_grouped_mm(x, q, rows_are_out) else 1e-2  # fp8 activations: W8A8
    assert (chosen.float() - want).norm() / want.norm() < tol
    assert grouped.has_scaled_grouped_mm(x, q, rows_are_out) or any(k[0].startswith("grouped-") for k in tune.tuning_log())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_stacks_compiled_with_inductor_run_the_rowwise_grouped_tensor_cores(monkeypatch):
    from torch_stagehand.kernels import grouped

    scaled = []
    real = grouped.scaled_grouped_mm
    monkeypatch.setattr(grouped, "scaled_grouped_mm", lambda *a: scaled.append(1) or real(*a))
    results = {}
    for math in ("grouped", "dense"):
        torch._dynamo.reset()
        model = moe_lora(_moe("qwen3_moe"))
        model.train()
        stagehand.offload(model, device="cuda", precision="fp8", verbose=False)
        ids = moe_inputs().cuda()
        compiled = torch.compile(model, backend="stagehand", options={"experts_math": math})
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        results[math] = (loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    assert scaled  # the grouped rewrite's forwards ran on FP8 tensor cores (the dense one dequantizes)
    (loss, grads), (want_loss, want_grads) = results["grouped"], results["dense"]
    assert abs(loss - want_loss) < 5e-2 * abs(want_loss)  # E4M3 activations in the grouped forward
    for name in want_grads:
        assert (grads[name] - want_grads[name]).norm() / want_grads[name].norm() < 0.15, name
