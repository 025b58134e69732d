"""Shared helpers for the backend tests: reference models and error measures."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import peft
import transformers
from safetensors.torch import save_file

from torch_stagehand.app.presets import tiny_llama
from torch_stagehand.config import Config
from torch_stagehand.kernels import dequantize, quantize_per_row
from torch_stagehand.runtime.blocks import find_blocks, streamed_layers

TESTS = Path(__file__).resolve().parent  # the tests' root: _helpers and the subprocess scripts' sys.path
ROOT = TESTS.parent  # the repository


def interpreted(script: str, timeout: int = 300) -> dict[str, dict]:
    """Run tests/SCRIPT under Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before
    Triton is imported): {case name: its JSON record}; a run with no record fails the calling test."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(TESTS / script)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise AssertionError(f"{script} produced no results (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return {rec["name"]: rec for rec in map(json.loads, lines)}


def report_cases(script: str, run_case, names: list[str]) -> None:
    """The body of an `interpreted` script: each case's JSON record on a line of its own (an exception in a case
    is its record: the parent test fails that case, the others still run)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"{script}: run with TRITON_INTERPRET=1")
    for name in names:
        try:
            rec = run_case(name)
        except Exception as e:  # noqa: BLE001 - reported per case
            rec = dict(name=name, exception=f"{type(e).__name__}: {e}")
        print(json.dumps(rec), flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_exact(actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    """Bitwise-equal values (shape and dtype too): for an fp32 path that runs the reference's own ops."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=msg)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """`rel_err(a, b) < tol`, where `tol == 0` asks for bitwise-equal values (a parametrised exact case)."""
    if tol == 0:
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return rel_err(a, b) < tol


def first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.logits if hasattr(out, "logits") else out[0]


def int8_reference(model: nn.Module, precision: dict[int, str] | str, quantizer: str = "mse") -> nn.Module:
    """A plain copy of `model` whose INT8 blocks hold dequantized weights: what INT8 streaming computes."""
    ref = copy.deepcopy(model)
    blocks = find_blocks(ref)
    precision = {b: precision for b in range(len(blocks))} if isinstance(precision, str) else precision
    with torch.no_grad():
        for spec in streamed_layers(ref, blocks):
            if precision.get(spec.block, "bf16") != "int8":
                continue
            w = spec.weight
            q, s = quantize_per_row(spec.as_matrix(w.detach()), method=quantizer)
            deq = dequantize(q, s, torch.float32)
            w.copy_((deq.t() if spec.transposed else deq).reshape(w.shape).to(w.dtype))
    return ref


class Block(nn.Module):
    def __init__(self, d: int, graph_break: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.graph_break = graph_break

    def forward(self, x):
        h = F.gelu(self.up(self.norm(x)))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.down(h)


class ToyModel(nn.Module):
    """Embedding linear, `n` pre-norm MLP blocks, head. Small enough for exact fp32 checks."""

    def __init__(self, d: int = 32, n: int = 4, graph_break_in: int | None = None):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d, graph_break=(i == graph_break_in)) for i in range(n)])
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def toy(d=32, n=4, dtype=torch.float32, graph_break_in=None, seed=0):
    torch.manual_seed(seed)
    model = ToyModel(d, n, graph_break_in).to(dtype)
    model.requires_grad_(False)
    x = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return model, x


# Each layer's pieces start on this boundary in a block's flat buffer (runtime/precision/layout.py ALIGN).
_BOUNDARY = 256


def _aligned(n: int) -> int:
    return -(-n // _BOUNDARY) * _BOUNDARY


def block_bytes_by_precision(model: nn.Module) -> dict[str, list[int]]:
    """Each block's streamed bytes in bf16 (the model's own dtype) and in int8, from the Linear shapes alone.

    Computed here, not read from the host store or the slot pool, so a residency bound
    built on it checks the pool instead of restating it. Call before `offload`.
    """
    blocks = find_blocks(model)
    full, int8 = [0] * len(blocks), [0] * len(blocks)
    for spec in streamed_layers(model, blocks):
        n, k = spec.out_features, spec.in_features
        full[spec.block] += _aligned(n * k * spec.module.weight.element_size())
        int8[spec.block] += _aligned(n * k) + _aligned(4 * n)  # int8 weight, fp32 per-row scale
    return {"bf16": full, "int8": int8}


def two_largest_blocks(block_bytes: dict[str, list[int]], precision: dict[int, str] | str) -> int:
    """The bytes of the two largest blocks in the precision each runs in: what two slots can hold at most."""
    n = len(block_bytes["bf16"])
    per_block = precision if isinstance(precision, dict) else {b: precision for b in range(n)}
    sizes = sorted((block_bytes[per_block.get(b, "bf16")][b] for b in range(n)), reverse=True)
    return sum(sizes[:2])


class CheckpointedToy(nn.Module):
    """A `ToyModel` whose blocks run through torch.utils.checkpoint, as HF / diffusers call them."""

    def __init__(self, inner: nn.Module, use_reentrant: bool = False):
        super().__init__()
        self.inner = inner
        self.use_reentrant = use_reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inner.embed(x)
        for block in self.inner.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.inner.head(x)


class RecordingPinner:
    """A pinner for CPU tests: records the ranges offload would page-lock (and can refuse the n-th one)."""

    locks = True

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.calls = 0
        self.locked: dict[int, int] = {}  # pointer -> bytes
        self.unlocked: list[int] = []
        self.drains = 0  # device synchronisations before unlocking (one per batch)

    def register(self, ptr: int, nbytes: int) -> None:
        from torch_stagehand.runtime.host.arena import PinError

        self.calls += 1
        if self.calls == self.fail_at:
            raise PinError(f"simulated: cudaHostRegister of {nbytes} bytes failed")
        assert ptr not in self.locked
        self.locked[ptr] = nbytes

    def drain(self) -> None:
        self.drains += 1

    def unregister(self, ptr: int) -> None:
        del self.locked[ptr]
        self.unlocked.append(ptr)


def page_locked(t) -> bool:
    """Are the pages under `t` page-locked for CUDA? Asks the driver about `t`'s own first byte.

    `Tensor.is_pinned()` asks about its storage's first byte only, so it says False for a buffer
    carved from a larger host allocation and locked in place (cudaHostRegister of its range),
    which is how the host store pins exactly what streams.
    """
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("page_locked: libcudart is not loaded in this process")
    cudart = ctypes.CDLL(sorted(paths)[0])
    attributes = (ctypes.c_int * 64)()  # cudaPointerAttributes: the memory type is its first field
    err = cudart.cudaPointerGetAttributes(attributes, ctypes.c_void_p(t.data_ptr()))
    if err != 0:
        raise RuntimeError(f"page_locked: cudaPointerGetAttributes failed with cudaError {err}")
    return attributes[0] == 1  # cudaMemoryTypeHost: page-locked host memory (0: unregistered)


def square_loss_step(call, model, x):
    """One forward and backward of `mean(out**2)` from cleared grads: the output and every gradient, copied."""
    for p in model.parameters():
        p.grad = None
    out = call(x)
    out.float().square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# Small real models and checkpoints several test folders build.


def lora_llama(seed: int = 0):
    model, inputs = tiny_llama()
    model.requires_grad_(False)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                             lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(seed)
    model = peft.get_peft_model(model, config)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.float().to(torch.bfloat16)
    return model, inputs


def sp_config(tmp_path, **kw) -> Config:
    # Thresholds that send below-average-gradient blocks down: sum(rel) = n, so at least one block has rel <= 1.
    fields = dict(mode="dynamic", warmup_steps=2, update_interval_steps=2, history_window=2,
                  min_steps_between_switches=0, int8_threshold=0.55, bf16_threshold=0.6, hysteresis_margin=0.0,
                  telemetry_file=str(tmp_path / "sp.jsonl"))
    fields.update(kw)
    return Config.from_dict({"selective_precision": fields})


def train_sgd(model, inputs, rt, steps: int, observe_loss: bool = False):
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rt.attach(opt)
    losses = []
    for _ in range(steps):
        loss = compiled(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        if observe_loss:
            rt.observe_loss(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return compiled, opt, losses


def saved_checkpoint(model, tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def tiny_qwen2(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    return model, {"input_ids": ids}


MOE_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, use_cache=False)


def moe_config(family: str):
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**MOE_COMMON, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                           num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**MOE_COMMON, intermediate_size=128, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                           decoder_sparse_step=1)
    if family == "mixtral":
        return transformers.MixtralConfig(**MOE_COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**MOE_COMMON, head_dim=16, intermediate_size=48, num_local_experts=8,
                                         num_experts_per_tok=2, sliding_window=8,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(**{**MOE_COMMON, "num_key_value_heads": 4}, intermediate_size=128, moe_intermediate_size=32,
                                             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                             first_k_dense_replace=0, n_group=2, topk_group=1, kv_lora_rank=16,
                                             q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    raise ValueError(family)


def moe_inputs(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, MOE_COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))


def moe_lora(model):
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["o_proj"], init_lora_weights=False))


def checkpoint_and_slab(tmp_path):
    """A toy model, its input, its safetensors checkpoint and the manifest of its blocks' INT8 slab."""
    from safetensors.torch import save_file

    from torch_stagehand.runtime.slab import build_slab_from_module

    from _helpers import toy

    model, x = toy(n=3, d=64)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    slab = build_slab_from_module(model, str(tmp_path), "toy", "toy", include_prefixes=("blocks.",),
                                  progress=False, print_report=False, compare_quantizers=False)
    return model, x, path, slab.manifest_path
