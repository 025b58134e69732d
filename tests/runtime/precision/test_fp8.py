"""fp8: E4M3 weights with a per-row scale, a third registered precision.

CPU: the host layout and quantization math, the refusal without FP8 tensor cores, the
explicit emulation, the measured policy file. GPU (marked): torch._scaled_mm forward and
grad-input against the dequantized weights.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.config import Config
from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.blocks import find_blocks, streamed_layers
from torch_stagehand.runtime.precision.fp8 import (
    E4M3, Fp8UnsupportedError, dequantize_rows_e4m3, quantize_rows_e4m3, scaled_grad_input, scaled_linear)
from torch_stagehand.runtime.selective import fp8_rules
from torch_stagehand.runtime.selective.fp8_rules import Fp8PolicyError

from _helpers import assert_exact, rel_err, toy


def test_quantize_rows_e4m3_maps_each_rows_absmax_to_448_and_round_trips():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different magnitude
    w[5] = 0.0
    q, s = quantize_rows_e4m3(w)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (64,)
    assert (q.float().abs().amax(1)[w.abs().amax(1) > 0] == 448.0).all()  # exactly: 448 is E4M3's largest value
    back = dequantize_rows_e4m3(q, s, torch.float32)
    assert (back[5] == 0).all()
    # E4M3 has 3 mantissa bits: relative error per element <= 2^-4, per row far less.
    assert rel_err(back, w) < 0.04
    assert ((back - w).abs() <= w.abs() * 2**-4 + s[:, None] * 2**-9).all()


def test_activation_quantizer_twin_is_per_row_absmax_with_an_optional_column_scale():
    from torch_stagehand.kernels.fp8_quant import quantize_rows, quantize_rows_ref

    torch.manual_seed(1)
    x = (torch.randn(6, 40) * torch.logspace(-2, 2, 6)[:, None]).bfloat16()
    x[3] = 0
    col = torch.rand(40) + 0.5
    for c in (None, col):
        q, s = quantize_rows(x, c)  # on the CPU: the twin
        v = x.double() * (1 if c is None else c.double())
        assert s.shape == (6, 1) and q.dtype == E4M3
        # the fp32 scale against float64: one rounding, measured 7.8e-8 relative (CPU, torch 2.13, 3 seeds)
        assert torch.allclose(s.double().squeeze(1), (v.abs().amax(1) / 448).clamp_min(1e-12), rtol=2e-7, atol=0)
        assert (q.float().abs().amax(1)[[0, 1, 2, 4, 5]] == 448).all()  # each row's max maps to 448, exactly
        assert rel_err(q.double() * s.double(), v) < 0.04  # 3 mantissa bits
        assert torch.equal(q.view(torch.uint8), quantize_rows_ref(x, c)[0].view(torch.uint8))
    with pytest.raises(ValueError, match="col_scale has 39 elements"):
        quantize_rows(x, col[:39])
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(x[0])


def test_fp8_streams_one_byte_per_weight_plus_a_row_scale_aligned():
    model, _ = toy(d=32, n=2)
    specs = streamed_layers(model, find_blocks(model))
    block0 = [s for s in specs if s.block == 0]
    layouts, nbytes = precisions.get("fp8").layout(block0)
    int8_layouts, int8_bytes = precisions.get("int8").layout(block0)
    assert nbytes == int8_bytes  # the same bytes as INT8 over PCIe
    for lay, spec in zip(layouts, block0):
        assert lay.offset % 256 == 0 and lay.scale_offset % 256 == 0 and lay.dtype == E4M3
        assert lay.scale_offset >= lay.offset + spec.out_features * spec.in_features
    assert precisions.get("fp8").code == 2 and precisions.by_code(2).name == "fp8"


def test_fp8_is_refused_without_fp8_tensor_cores_and_the_model_is_left_as_it_was():
    model, x = toy(d=32, n=2)
    weight = model.blocks[0].up.weight
    with pytest.raises(Fp8UnsupportedError, match="FP8 tensor cores.*fp8_emulate"):
        stagehand.offload(model, device="cpu", precision="fp8")
    assert model.blocks[0].up.weight is weight and type(model.blocks[0].up) is torch.nn.Linear
    rt = stagehand.offload(model, device="cpu")
    with pytest.raises(Fp8UnsupportedError):
        rt.set_precision({1: "fp8"})
    assert rt.precision == {0: "bf16", 1: "bf16"}


def toy_and_fp8_reference():
    """The toy model, its input, and a copy whose block 1 holds the weights fp8 stores (dequantized)."""
    model, x = toy(d=32, n=3)
    ref = toy(d=32, n=3)[0]
    with torch.no_grad():
        for lin in (ref.blocks[1].up, ref.blocks[1].down):
            q, s = quantize_rows_e4m3(lin.weight)
            lin.weight.copy_(dequantize_rows_e4m3(q, s, torch.float32))
    return model, x, ref


def test_fp8_emulation_when_asked_computes_the_dequantized_weights_compiled():
    model, x, ref = toy_and_fp8_reference()
    with torch.no_grad():
        expected, plain = ref(x), toy(d=32, n=3)[0](x)
    config = Config.from_dict({"selective_precision": {"fp8_emulate": True}})
    rt = stagehand.offload(model, device="cpu", precision={1: "fp8"}, config=config)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    with torch.no_grad():
        out = compiled(x)
    assert_exact(out, expected)  # measured 0 (CPU, torch 2.13, 3 seeds): emulation is F.linear on those weights
    assert 0 < rel_err(out, plain) < 3e-2  # measured 1.1e-2 (CPU, torch 2.13, 3 seeds)
    assert rt.stats()["precision_counts"] == {"bf16": 2, "fp8": 1}


def test_fp8_bias_is_an_add_in_the_graph_and_its_gradient_flows():
    """fp8's GEMM takes no bias (cuBLASLt refuses it at some shapes): the rewrite passes the op none and
    adds the bias in the graph, where Inductor fuses it into the next op. Numbers and gradients (the bias
    trainable here) equal the dequantized model's."""
    model, x, ref = toy_and_fp8_reference()
    for m in (model, ref):
        m.blocks[1].up.bias.requires_grad_(True)
    config = Config.from_dict({"selective_precision": {"fp8_emulate": True}})
    rt = stagehand.offload(model, device="cpu", precision={1: "fp8"}, config=config, verbose=False)
    report = stagehand.explain(model, x)
    fp8_graph = next(g for k, g in report.graphs.items() if k.endswith("fp8].scheduled"))
    bf16_graph = next(g for k, g in report.graphs.items() if k.endswith("bf16].scheduled"))
    fp8_linears = [ln for ln in fp8_graph.splitlines() if "stagehand.linear.default(" in ln]
    assert fp8_linears and all("wait_default, None," in ln for ln in fp8_linears)
    assert "aten.add.Tensor(linear_default, " in fp8_graph
    assert "aten.add.Tensor(linear_default" not in bf16_graph  # bf16's GEMM adds its bias itself
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    out = compiled(x)
    expected = ref(x)
    assert_exact(out, expected)  # measured 0 (CPU, torch 2.13, 3 seeds), the bias added in the graph or not
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_exact(model.blocks[1].up.bias.grad, ref.blocks[1].up.bias.grad)  # measured 0
    rt.restore()


def test_by_role_fp8_puts_the_bias_in_the_graph_for_its_fp8_layers_only():
    """"fp8-mlp": attention in bf16 (its GEMM adds the bias), the MLP in fp8 (the graph adds it)."""
    from torch_stagehand.runtime.precision import LayerLayout

    entry = precisions.get("fp8-mlp")
    stored = {role: LayerLayout(entry.code, 0, 64, 32, -1 if dtype != E4M3 else 2048, False,
                                precisions.DTYPE_CODES[dtype]) for role, dtype in (("attn", torch.bfloat16),
                                                                                   ("mlp", E4M3))}
    assert not entry.bias_in_graph(stored["attn"]) and entry.bias_in_graph(stored["mlp"])
    assert not precisions.get("int8").bias_in_graph(stored["mlp"])


def test_fp8_rules_from_measurements_keep_only_shapes_faster_from_a_token_count_up(tmp_path):
    rows = [
        {"out_features": 64, "in_features": 64, "tokens": t, "speedup": s}
        for t, s in [(256, 0.7), (1024, 1.05), (4096, 0.99), (16384, 1.3)]
    ] + [
        {"out_features": 128, "in_features": 64, "tokens": t, "speedup": s}
        for t, s in [(256, 0.9), (1024, 1.1), (4096, 1.2)]
    ] + [{"out_features": 32, "in_features": 32, "tokens": 4096, "speedup": 0.8}]
    rules = fp8_rules.rules_from_measurements(rows, 1.0)
    assert [(r.out_features, r.in_features, r.min_tokens) for r in rules] == [(64, 64, 16384), (128, 64, 1024)]
    policy = fp8_rules.Fp8Policy("dev", 1.0, rules)
    assert policy.layer_takes_fp8(128, 64, 2048) and not policy.layer_takes_fp8(128, 64, 512)
    assert not policy.layer_takes_fp8(32, 32, 10**6)  # no rule: bf16 is not slower
    assert not policy.block_takes_fp8([(128, 64), (64, 64)], 4096)  # one layer slower: the block stays
    assert policy.block_takes_fp8([(128, 64), (64, 64)], 16384)
    path = str(tmp_path / "p.json")
    fp8_rules.save(policy, path)
    assert fp8_rules.load(path).rules == rules
    with pytest.raises(Fp8PolicyError, match="measured on 'dev'"):
        fp8_rules.load(path, "NVIDIA H100")
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "rules": []}))
    with pytest.raises(Fp8PolicyError, match="bad.json: not an FP8 policy file"):
        fp8_rules.load(str(tmp_path / "bad.json"))
    with pytest.raises(Fp8PolicyError, match="no FP8 policy file"):
        fp8_rules.load(str(tmp_path / "missing.json"))


def test_the_policy_sends_a_block_to_fp8_only_where_its_layers_were_measured_faster(tmp_path):
    # toy d=32: up [64, 32], down [32, 64]. Rules for both at >= 512 tokens; none for a token count below.
    rules = [fp8_rules.Fp8Rule(64, 32, 512, 1.2), fp8_rules.Fp8Rule(32, 64, 512, 1.1)]
    path = str(tmp_path / "fp8.json")
    fp8_rules.save(fp8_rules.Fp8Policy("cpu", 1.0, rules), path)
    for tokens, low in [(1024, "fp8"), (256, "int8")]:
        model, _ = toy(d=32, n=2)
        config = Config.from_dict({"selective_precision": {
            "mode": "dynamic", "fp8_policy_file": path, "fp8_tokens": tokens, "fp8_emulate": True}})
        rt = stagehand.offload(model, device="cpu", config=config)
        assert rt.selective.low_for(0) == low and rt.selective.low_for(1) == low
        new, _ = rt.selective.policy.update(10, rt.precision, [0.0, 4.0])
        assert new == {0: low, 1: "bf16"}
        rt.restore()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k", [40, 3072, 12288, 20000])  # up to 16384 one read per row, longer two
def test_gpu_activation_quantizer_kernel_equals_its_twin_bit_for_bit(k):
    from torch_stagehand.kernels.fp8_quant import QUANT_MEMO, quantize_rows, quantize_rows_ref

    QUANT_MEMO.clear()
    torch.manual_seed(k)
    col = torch.rand(k, device="cuda") + 0.5
    for attempt in range(2):  # the second pass replays the launches the first recorded, on new tensors
        big = (torch.randn(70, k + 8, device="cuda") * 4).bfloat16()
        x = big[:, 8:]  # rows with a stride wider than k
        x[7] = 0
        for c in (None, col):
            q, s = quantize_rows(x, c)
            qr, sr = quantize_rows_ref(x, c)
            assert torch.equal(s, sr)
            assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert QUANT_MEMO.stats() == {"keys": 2, "hits": 2, "misses": 2}


_TRANSPOSE_CHECK = """
import torch
from torch_stagehand.kernels.fp8_quant import transpose_bytes
for n, k, tile in ((37, 70, 16), (130, 129, 64), (5, 300, 128)):
    q = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    t = transpose_bytes(q, tile=tile)
    assert t.shape == (k, n) and t.is_contiguous() and torch.equal(t, q.t().contiguous()), (n, k, tile)
q8 = (torch.randn(33, 48) * 50).to(torch.float8_e4m3fn)
t8 = transpose_bytes(q8, tile=16)
assert t8.dtype == q8.dtype and torch.equal(t8.view(torch.uint8), q8.view(torch.uint8).t().contiguous())
print("transpose ok")
"""


def test_byte_transpose_kernel_in_the_interpreter_on_ragged_tiles():
    """The grad-input's column-major weight copy: the Triton kernel itself (TRITON_INTERPRET=1, in a
    subprocess: the variable must be set before Triton is imported)."""
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _TRANSPOSE_CHECK], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "transpose ok" in proc.stdout, proc.stderr[-3000:]


def test_byte_transpose_refuses_what_it_cannot_copy_by_rows():
    from torch_stagehand.kernels.fp8_quant import transpose_bytes

    with pytest.raises(ValueError, match="contiguous 2-D 1-byte"):
        transpose_bytes(torch.zeros(4, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous 2-D 1-byte"):
        transpose_bytes(torch.zeros(6, 4, dtype=torch.uint8).t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_byte_transpose_equals_torch_and_replays():
    from torch_stagehand.kernels.fp8_quant import TRANSPOSE_MEMO, transpose_bytes

    TRANSPOSE_MEMO.clear()
    for _ in range(2):  # the second call replays the recorded launch on a new tensor
        q = (torch.randn(3072, 1000, device="cuda") * 40).to(E4M3)
        t = transpose_bytes(q)
        assert t.dtype == E4M3 and torch.equal(t.view(torch.uint8), q.view(torch.uint8).t().contiguous())
    assert TRANSPOSE_MEMO.stats() == {"keys": 1, "hits": 1, "misses": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 tensor cores")
@pytest.mark.parametrize("m", [16, 256, 4096])
def test_scaled_mm_forward_and_grad_input_match_the_dequantized_weights(m):
    torch.manual_seed(0)
    n, k = 3072, 1024
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    q, s = quantize_rows_e4m3(w)
    deq = dequantize_rows_e4m3(q, s, torch.float32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = scaled_linear(x, q, s, bias)
    dx = scaled_grad_input(dy, q, s)
    assert y.dtype == dx.dtype == torch.bfloat16
    # The activation is rounded to E4M3 too (3 mantissa bits): a few % relative error.
    assert rel_err(y, x.float() @ deq.t() + bias.float()) < 0.05
    assert rel_err(dx, dy.float() @ deq) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 tensor cores")
def test_fp8_blocks_train_lora_on_the_gpu_close_to_bf16():
    model, x = toy(d=256, n=3, dtype=torch.bfloat16)
    ref = toy(d=256, n=3, dtype=torch.bfloat16)[0].cuda()
    rt = stagehand.offload(model, device="cuda", precision={1: "fp8", 2: "fp8"})
    x = x.cuda().requires_grad_(True)
    compiled = torch.compile(model, backend="stagehand")
    out = compiled(x)
    out.float().square().mean().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    ref(x_ref).float().square().mean().backward()
    assert rel_err(out, ref(x_ref.detach())) < 0.08
    assert rel_err(x.grad, x_ref.grad) < 0.1
    assert rt.stats()["precision_counts"] == {"bf16": 1, "fp8": 2}
