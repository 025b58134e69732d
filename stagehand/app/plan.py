"""`stagehand plan FOLDER`: the plan this backend would run for a checkpoint folder, before any weight is read.

The model is built from the folder's config on the meta device (no weights, no GPU). Its blocks are found as
`offload` finds them, their bytes counted per precision, the host memory counted as offload's preflight counts
it, and the activations a training step saves measured by a forward on the meta device (shapes only). The VRAM
plan is `make_plan`'s under the default cost model: its times are the default model's, not this machine's. The
host memory is counted for the machine that runs the command (where `keep_full="auto"` puts the masters).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.blocks import BlockSelectionError, find_blocks, streamed_layers
from torch_stagehand.runtime.conductor.costs import (DEFAULT_BLOCK_SECONDS, DEFAULT_H2D_BPS, BlockCost, Budget,
                                                     CostModel, human, parse_bytes)
from torch_stagehand.runtime.conductor.planner import RECOMPUTE, SPILL, BudgetError, make_plan
from torch_stagehand.runtime.host import budget as host_budget
from torch_stagehand.runtime.host.plan import HostPlan, plan_host
from torch_stagehand.runtime.host.weights_file import PIPELINE_INDEX, denoiser_first, pipeline_components
from torch_stagehand.runtime.train.host import STATE_BYTES

TRAIN = ("lora", "full", "none")
PRECISIONS = ("bf16", "int8", "fp8")
LORA_RANK = 16


class PlanInputError(ValueError):
    """Bad input to `stagehand plan`: the message names the file, the field or the number."""


@dataclass
class FolderPlan:
    folder: str
    architecture: str
    kind: str  # "transformers" | "diffusers"
    blocks: int
    block_lists: list[str]
    parameters: int
    streamed_parameters: int
    bytes_per_precision: dict[str, int]  # the streamed weights, every block in that precision
    precision: str
    train: str
    tokens: int
    host: HostPlan  # the copies offload's preflight counts: kind -> bytes, and the RAM / page-locked totals
    optimizer_bytes: int  # HostAdamW's fp32 masters and moments (train="full")
    resident_bytes: int  # what stays on the GPU outside the blocks (embeddings, head, norms, LoRA)
    activations: str  # how the activations were found
    vram: dict[str, Any] = field(default_factory=dict)
    host_usable_bytes: int | None = None  # what this machine's host memory can give now (the preflight's reading)

    def to_json(self) -> dict:
        return {**self.__dict__, "host": {"bytes_by_kind": dict(self.host.bytes), "keep_full": self.host.keep_full,
                                          "ram_bytes": self.host.ram_bytes, "pinned_bytes": self.host.pinned_bytes}}


def _read_config(folder: str) -> tuple[str, dict]:
    if not os.path.isdir(folder):
        raise PlanInputError(f"{folder}: not a folder")
    if os.path.isfile(os.path.join(folder, PIPELINE_INDEX)):
        models = denoiser_first(pipeline_components(folder))
        sub = next((name for name in ("transformer", "unet") if name in models or os.path.isdir(
            os.path.join(folder, name))), None)  # a denoiser's folder model_index.json may not list
        hint = f": plan its {sub}, {os.path.join(folder, sub)}" if sub is not None else (
            f": plan one of its models, {', '.join(os.path.join(folder, n) for n in models)}" if models else "")
        raise PlanInputError(f"{folder}: a diffusers pipeline folder ({PIPELINE_INDEX}){hint}")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise PlanInputError(f"{folder}: no config.json (a transformers or diffusers model folder has one)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanInputError(f"{path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise PlanInputError(f"{path}: not a model config (a JSON object), got a {type(config).__name__}")
    return path, config


def build_on_meta(folder: str) -> tuple[nn.Module, str, str]:
    """The folder's model with every tensor on the meta device, in bf16; its class name and its library."""
    path, config = _read_config(folder)
    if "_class_name" in config:  # diffusers
        import diffusers

        name = config["_class_name"]
        cls = getattr(diffusers, name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise PlanInputError(f"{path}: unknown diffusers model class {name!r}")
        try:
            with torch.device("meta"):
                model = cls.from_config(cls.load_config(folder))
        except Exception as e:  # the library's own reason a config does not build: one line naming the file
            raise PlanInputError(f"{path}: {name} does not build from it ({type(e).__name__}: {e})") from None
        return model.to(torch.bfloat16), name, "diffusers"
    import transformers

    architectures = config.get("architectures") or []
    if not architectures:
        raise PlanInputError(f"{path}: names no architecture ('architectures' for transformers, "
                             f"'_class_name' for diffusers)")
    name = architectures[0]
    cls = getattr(transformers, name, None)
    if cls is None:
        raise PlanInputError(f"{path}: unknown architecture {name!r} (transformers {transformers.__version__} "
                             f"has no such class)")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(folder)
        hf_config.use_cache = False
        with torch.device("meta"):
            model = cls._from_config(hf_config, dtype=torch.bfloat16)
    except Exception as e:  # the library's own reason a config does not build: one line naming the file
        raise PlanInputError(f"{path}: {name} does not build from it ({type(e).__name__}: {e})") from None
    return model, name, "transformers"


def _example_inputs(model: nn.Module, kind: str, tokens: int) -> dict | None:
    """Meta inputs of one training sample of `tokens` tokens, for the model classes we know; None otherwise."""
    meta = dict(device="meta")
    if kind == "transformers":  # a 4-D mask: the model builds none (its mask helpers read values, which meta has not)
        return {"input_ids": torch.zeros(1, tokens, dtype=torch.long, **meta),
                "attention_mask": torch.ones(1, 1, tokens, tokens, dtype=torch.bool, **meta)}
    config = model.config
    if type(model).__name__ == "FluxTransformer2DModel":
        text = 512
        return {"hidden_states": torch.zeros(1, tokens, config.in_channels, dtype=torch.bfloat16, **meta),
                "encoder_hidden_states": torch.zeros(1, text, config.joint_attention_dim, dtype=torch.bfloat16,
                                                     **meta),
                "pooled_projections": torch.zeros(1, config.pooled_projection_dim, dtype=torch.bfloat16, **meta),
                "timestep": torch.zeros(1, dtype=torch.bfloat16, **meta),
                "guidance": torch.zeros(1, dtype=torch.bfloat16, **meta) if config.guidance_embeds else None,
                "img_ids": torch.zeros(tokens, 3, dtype=torch.bfloat16, **meta),
                "txt_ids": torch.zeros(text, 3, dtype=torch.bfloat16, **meta), "return_dict": False}
    return None


class _FlashAttentionSaves(torch.autograd.Function):
    """Attention as a fused GPU kernel keeps it for the backward: q, k, v, the output and the row log-sum-exp
    (the math path's T x T weights, which the meta device would otherwise save, never exist on the GPU)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_like_sdpa(query, key, value, *args, **kwargs):
    return _FlashAttentionSaves.apply(query, key, value)


def measure_activations(model: nn.Module, block_fqns: list[str], inputs: dict, lora: Sequence[nn.Module] = ()
                        ) -> tuple[list[int], list[int]]:
    """Per block: the bytes its forward saves for the backward, and the bytes of its inputs (what a recompute
    keeps instead), from one forward on the meta device. Weights a block saves are not activations: skipped.
    `lora`: Linears given a rank-16 adapter for the measurement (its A saves the Linear's input)."""
    index = {fqn: b for b, fqn in enumerate(block_fqns)}
    saved, kept = [0] * len(block_fqns), [0] * len(block_fqns)
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: list[set] = [set() for _ in block_fqns]  # a tensor saved by several ops (q, k, v's input) is held once
    current: list[int] = []
    handles = []

    def pre(block):
        def hook(module, args, kwargs):
            current.append(block)
            kept[block] = sum(t.numel() * t.element_size() for t in (*args, *kwargs.values())
                              if isinstance(t, torch.Tensor) and t.is_floating_point())
        return hook

    def post(module, args, kwargs, out):
        current.pop()

    for fqn, block in index.items():
        module = model.get_submodule(fqn)
        handles += [module.register_forward_pre_hook(pre(block), with_kwargs=True),
                    module.register_forward_hook(post, with_kwargs=True)]
    for spec in lora:
        a = torch.empty(LORA_RANK, spec.in_features, device="meta", dtype=torch.bfloat16, requires_grad=True)
        b = torch.empty(spec.out_features, LORA_RANK, device="meta", dtype=torch.bfloat16, requires_grad=True)
        weights |= {a.untyped_storage()._cdata, b.untyped_storage()._cdata}
        handles.append(spec.module.register_forward_hook(lambda m, args, out, a=a, b=b: out + args[0] @ a.t() @ b.t()))

    def pack(t):
        key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape))
        if current and key[0] not in weights and key not in seen[current[-1]]:
            seen[current[-1]].add(key)
            saved[current[-1]] += t.numel() * t.element_size()
        return t

    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _flash_like_sdpa
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        for h in handles:
            h.remove()
    return saved, kept


def plan_folder(folder: str, vram_budget: str | int, precision: str = "int8", train: str = "lora",
                tokens: int = 4096) -> FolderPlan:
    if precision not in PRECISIONS:
        raise PlanInputError(f"--precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if train not in TRAIN:
        raise PlanInputError(f"--train: {train!r} is not one of {', '.join(TRAIN)}")
    if tokens <= 0:
        raise PlanInputError(f"--tokens: {tokens} is not a positive number of tokens")
    try:
        budget_bytes = parse_bytes(vram_budget, "--vram-budget")
    except ValueError as e:
        raise PlanInputError(str(e)) from None
    model, name, kind = build_on_meta(folder)
    try:
        block_fqns = find_blocks(model)
    except BlockSelectionError as e:
        raise PlanInputError(f"{folder}: {e}") from None
    layers = streamed_layers(model, block_fqns)
    n = len(block_fqns)
    per_block = [[s for s in layers if s.block == b] for b in range(n)]
    bytes_of = {p: [precisions.get(p).layout(ls)[1] for ls in per_block] for p in PRECISIONS}
    streamed_ids = {id(s.weight) for s in layers}
    total = sum(p.numel() for p in model.parameters())
    streamed = sum(s.weight.numel() for s in layers)
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in streamed_ids)

    model.requires_grad_(train == "full")  # what trains decides what the meta forward saves
    adapted = [s for s in layers if train == "lora" and not s.experts]  # LoRA r=16 on every streamed Linear
    lora = sum(LORA_RANK * (s.in_features + s.out_features) for s in adapted)
    optimizer = 0
    if train == "full":
        # HostAdamW: an fp32 master and fp32 moments (12 bytes a parameter). The streamed weights' states on the
        # host; the other parameters' on the GPU with their bf16 gradient, as resident_states="auto" puts them
        # while they fit.
        per_param = int(STATE_BYTES["fp32"] + 4)
        optimizer = streamed * per_param
        resident += (total - streamed) * (per_param + 2)
    elif train == "lora":
        resident += lora * 8  # bf16 weights and gradients, and AdamW's two moments in the weights' dtype
    machine = host_budget.probe_machine()  # (the preflight's reading: a test replaces it there)
    host = plan_host(layers, n, {b: precision for b in range(n)}, "auto", True, machine,
                     [True] * n, 0, has_file=any(f.endswith(".safetensors") for f in os.listdir(folder)),
                     training_blocks=tuple(range(n)) if train == "full" else ())

    inputs = _example_inputs(model, kind, tokens) if train != "none" else None
    if train == "none":
        saved, kept, how = [0] * n, [0] * n, "none kept (no training step)"
    elif inputs is None:
        saved, kept, how = [0] * n, [0] * n, f"not estimated: stagehand plan has no example inputs for {name}"
    else:
        try:
            saved, kept = measure_activations(model, block_fqns, inputs, adapted)
            how = f"measured by a forward on the meta device, batch 1 x {tokens} tokens"
        except Exception as e:  # an op without a meta kernel: the plan stands on the weights alone, and says so
            saved, kept, how = [0] * n, [0] * n, f"not estimated: the meta forward failed ({type(e).__name__}: {e})"
    backward = 0.0 if train == "none" else 2 * DEFAULT_BLOCK_SECONDS
    grads = bytes_of["bf16"] if train == "full" else [0] * n  # full: each block's weight gradients go home
    costs = [BlockCost(bytes_of[precision][b], backward_s=backward, activation_bytes=saved[b], input_bytes=kept[b],
                       grad_bytes=grads[b]) for b in range(n)]
    cost_model = CostModel(base_bytes=resident, d2h_bps=DEFAULT_H2D_BPS)
    try:
        plan = make_plan(costs, [precision] * n, Budget(soft=budget_bytes), cost_model)
    except BudgetError as e:
        raise PlanInputError(f"--vram-budget {vram_budget}: {str(e).removeprefix('planner: ')}") from None
    vram = {"budget_bytes": budget_bytes, "resident_blocks": [b.block for b in plan.blocks if b.resident],
            "streamed_blocks": [b.block for b in plan.blocks if not b.resident],
            "recomputed_blocks": [b.block for b in plan.blocks if b.activations == RECOMPUTE],
            "spilled_blocks": [b.block for b in plan.blocks if b.activations == SPILL],
            "slots": plan.slots, "predicted_peak_bytes": int(plan.predicted_peak_bytes),
            "predicted_step_s": plan.predicted_step_s, "h2d_bytes_per_step": sum(b.h2d_bytes for b in plan.blocks),
            "cost_model": f"default (link {cost_model.h2d_bps / 1e9:.0f} GB/s, {1e3 * costs[0].forward_s:.0f} ms "
                          "forward per block): not this machine's; the first steps of a run measure both"}
    return FolderPlan(folder, name, kind, n, sorted({f.rsplit(".", 1)[0] for f in block_fqns}), total, streamed,
                      {p: sum(v) for p, v in bytes_of.items()}, precision, train, tokens, host, optimizer,
                      resident, how, vram, machine.usable_bytes)


def render(plan: FolderPlan) -> str:
    v = plan.vram
    lines = [f"{plan.folder}: {plan.architecture} ({plan.kind}), {plan.blocks} blocks in "
             f"{', '.join(plan.block_lists)}",
             f"  {plan.parameters:,} parameters, {plan.streamed_parameters:,} of them streamed",
             "  streamed weights: " + ", ".join(f"{p} {human(n)}" for p, n in plan.bytes_per_precision.items()),
             f"  host memory ({plan.precision}, train={plan.train}): {human(plan.host.ram_bytes)} RAM, of it "
             f"{human(plan.host.pinned_bytes)} page-locked"
             + (f"; HostAdamW's fp32 masters and moments {human(plan.optimizer_bytes)} more" if plan.optimizer_bytes
                else ""),
             "    " + ", ".join(f"{k} {human(n)}" for k, n in plan.host.bytes.items()),
             *([f"    more than this machine can give now ({human(plan.host_usable_bytes)}): offload here would stop "
                "at its host-memory preflight (HostMemoryError)"]
               if plan.host_usable_bytes is not None and plan.host.node_need() > plan.host_usable_bytes else []),
             f"  on the GPU outside the blocks: {human(plan.resident_bytes)}",
             f"  activations: {plan.activations}",
             f"  VRAM plan for {human(v['budget_bytes'])}: {len(v['resident_blocks'])} blocks resident, "
             f"{len(v['streamed_blocks'])} streamed"
             + (f" through {v['slots']} slots" if v["streamed_blocks"] else "") + f", {len(v['recomputed_blocks'])} "
             f"recomputed, {len(v['spilled_blocks'])} spilled; predicted peak {human(v['predicted_peak_bytes'])}",
             f"  step bound {v['predicted_step_s'] * 1e3:.0f} ms under the {v['cost_model']}"]
    return "\n".join(lines)
