"""Built-in targets for `stagehand inspect/schedule`, the tests and the benches, or `path/to/file.py:factory`.

Each factory returns `(model, example_inputs)`: a tuple (positional) or a dict (keyword arguments). Models are
real HF transformers / diffusers classes from small configs with random init, except `dit-48x3072`, the
performance workload's shape: 48 uniform pre-norm blocks, hidden 3072, 24 heads, MLP 4x (10.9 GB of BF16 Linears).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Example = tuple[nn.Module, Any]


def call_model(fn, example_inputs: Any):
    """fn(**inputs), fn(*inputs) or fn(inputs), as a target's example inputs are shaped (fn: the model, or
    anything called like it)."""
    if isinstance(example_inputs, dict):
        return fn(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return fn(*example_inputs)
    return fn(example_inputs)


class DiTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)); x + mlp(ln(x))."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=True)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=True)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class DiT(nn.Module):
    def __init__(self, depth: int = 48, hidden: int = 3072, heads: int = 24, in_channels: int = 64):
        super().__init__()
        self.embed = nn.Linear(in_channels, hidden)
        self.blocks = nn.ModuleList([DiTBlock(hidden, heads) for _ in range(depth)])
        self.norm_out = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, in_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm_out(h))


def dit(depth=48, hidden=3072, heads=24, tokens=256, batch=1, dtype=torch.bfloat16, device="cpu", init="normal") -> Example:
    """init="normal": N(0, 0.02) weights; "zeros": fast (for tables and graphs only, never for timing)."""
    with torch.device("meta"):
        model = DiT(depth, hidden, heads)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2 and init == "normal":
                p.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("weight") and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.zero_()
    x = torch.randn(batch, tokens, 64, generator=gen, device=device).to(dtype)
    return model.requires_grad_(False), (x,)


def tiny_llama(dtype=torch.bfloat16, layers=4, batch=2, seq=16, seed=0) -> Example:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return model, {"input_ids": ids}


def tiny_gpt2(dtype=torch.bfloat16, layers=4, batch=2, seq=16, seed=0) -> Example:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=256, n_embd=64, n_layer=layers, n_head=4, n_positions=256,
                        attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(dtype).eval()
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return model, {"input_ids": ids}


def tiny_flux(dtype=torch.bfloat16, double=2, single=2, batch=1, image_tokens=16, text_tokens=8, seed=0) -> Example:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=double, num_single_layers=single, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    inputs = {
        "hidden_states": torch.randn(batch, image_tokens, 16, generator=gen).to(dtype),
        "encoder_hidden_states": torch.randn(batch, text_tokens, 32, generator=gen).to(dtype),
        "pooled_projections": torch.randn(batch, 32, generator=gen).to(dtype),
        "timestep": torch.full((batch,), 0.5, dtype=dtype),
        "img_ids": torch.zeros(image_tokens, 3, dtype=dtype),
        "txt_ids": torch.zeros(text_tokens, 3, dtype=dtype),
        "return_dict": False,
    }
    return model, inputs


PRESETS: dict[str, Callable[..., Example]] = {"tiny-llama": tiny_llama, "tiny-gpt2": tiny_gpt2, "tiny-flux": tiny_flux,
                                              "dit-48x3072": dit}


class TargetError(ValueError):
    pass


def load_target(target: str, **kwargs) -> Example:
    """A preset name or `path/to/file.py:factory`."""
    if target in PRESETS:
        return PRESETS[target](**kwargs)
    if ":" not in target:
        raise TargetError(f"unknown target {target!r}: use one of {', '.join(PRESETS)} or path/to/file.py:factory")
    path, _, name = target.rpartition(":")
    if not os.path.isfile(path):
        raise TargetError(f"target {target!r}: no file {path!r}")
    spec = importlib.util.spec_from_file_location(f"stagehand_target_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise TargetError(f"target {target!r}: {path} has no function {name!r}")
    result = factory(**kwargs)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise TargetError(f"target {target!r}: {name}() must return (model, example_inputs)")
    return result
