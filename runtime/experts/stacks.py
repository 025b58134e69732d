"""Mixture-of-experts stacks that stream: the op the model reads them through, eagerly and in a compiled block.

Each 3-D stack of a swapped experts module (`streamed.StreamedExpertsMixin`) is a property calling
`stagehand::streamed_experts`, which eagerly returns the stack on the device; a compiled block reads the slot
(`expert_weights_from_slot`, `grouped_experts_from_slot`). Streamed experts are frozen (LoRA via peft's
`target_parameters`, experts/lora.py): a stack that requires grad is refused in a grad-enabled forward."""

from __future__ import annotations

import torch
from torch.library import custom_op

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime import registry
from torch_stagehand.runtime.precision import LayerLayout
from torch_stagehand.runtime.precision.traced import in_graph
from torch_stagehand.runtime.streamed import (HostMasterParameter, guard_on_runtime, make_streamed, runtime_key,
                                              streamed_experts_class)


class StreamedExpertsTrainError(RuntimeError):
    """A streamed expert stack requires grad in a training forward: streamed experts are frozen."""


@custom_op("stagehand::streamed_experts", mutates_args=())
def streamed_experts(block_tok: torch.Tensor, position: int, shape: list[int], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """The `position`-th streamed layer of the block `block_tok` names, an expert stack, on the device."""
    rt, block = registry.decode(block_tok)
    if rt is None:
        raise RuntimeError("stagehand: a streamed expert stack was read with the no-block token")
    return rt.eager.stack(rt.layer_at(block, position), dtype, None)


@streamed_experts.register_fake
def _(block_tok, position, shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


STREAMED_EXPERTS_OPS = (torch.ops.stagehand.streamed_experts, torch.ops.stagehand.streamed_experts.default)
EXPERTS_ARGS = ("block_tok", "position", "shape", "dtype", "device")


def dense_from_slot(slot: torch.Tensor, lay: LayerLayout, dtype: torch.dtype) -> torch.Tensor:
    """A layer's [out, in] rows in `dtype`: a view of the slot for the full-precision copy, else dequantized."""
    views = precisions.by_code(lay.code).views(slot, lay)
    if len(views) == 1:
        return views[0] if views[0].dtype == dtype else views[0].to(dtype)
    q, s = views
    return (q.to(torch.float32) * s.reshape(-1, 1)).to(dtype)


@custom_op("stagehand::grouped_experts", mutates_args=())
def grouped_experts(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                    rows_are_out: bool) -> torch.Tensor:
    """Per expert e, x[its rows] @ B_e from the one-byte stack q [E, R, C] and scales [E, R] (kernels/grouped.py)."""
    from torch_stagehand import kernels

    return kernels.grouped_lowbit(x, q, scale, offs, rows_are_out)


@grouped_experts.register_fake
def _(x, q, scale, offs, rows_are_out):
    from torch_stagehand.kernels import grouped_out_features

    return x.new_empty(x.shape[0], grouped_out_features(q, rows_are_out))


def _grouped_setup(ctx, inputs, output):
    _x, q, scale, offs, rows_are_out = inputs
    ctx.rows_are_out = rows_are_out
    # `refetch_weights` makes the backward read these from the block's wait_bw slot instead.
    ctx.save_for_backward(q, scale, offs)


def _grouped_backward(ctx, dy):
    q, scale, offs = ctx.saved_tensors
    # dx = dy @ B_e^T: the same product with the stack's two dimensions in each other's roles.
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    return torch.ops.stagehand.grouped_experts(dy, q, scale, offs, not ctx.rows_are_out), None, None, None, None


grouped_experts.register_autograd(_grouped_backward, setup_context=_grouped_setup)


@in_graph
def grouped_experts_from_slot(x: torch.Tensor, slot: torch.Tensor, offs: torch.Tensor, layout: list[int],
                              shape: list[int], rows_are_out: bool) -> torch.Tensor:
    """A grouped GEMM with a one-byte expert stack, from the block's slot (rewrite_linear's)."""
    lay = LayerLayout.from_ints(list(layout))
    q, s = precisions.by_code(lay.code).views(slot, lay)
    experts = shape[0]
    return torch.ops.stagehand.grouped_experts(x, q.view(experts, -1, q.shape[-1]), s.view(experts, -1), offs,
                                               rows_are_out)


@in_graph
def expert_weights_from_slot(slot: torch.Tensor, layout: list[int], shape: list[int],
                             dtype: torch.dtype) -> torch.Tensor:
    """An expert stack in the module's shape, read from the block's slot: what a compiled block computes with."""
    return dense_from_slot(slot, LayerLayout.from_ints(list(layout)), dtype).view(shape)


def _read_stack(module, name: str) -> torch.Tensor:
    """The property behind each streamed stack (streamed.streamed_experts_class)."""
    position, shape, dtype = module._sh_stacks[name]  # no read of the parameter: Dynamo would lift it
    if module._sh_trains[name] and torch.is_grad_enabled():
        raise StreamedExpertsTrainError(
            f"stagehand: {module._sh_fqn}.{name} streams and requires grad; streamed experts are frozen "
            "(train them with LoRA: peft's target_parameters), so freeze its parameter (the one named "
            f"{module._sh_fqn}.{name} in named_parameters(); the module's attribute reads the stream) or run "
            "this forward under torch.no_grad()")
    reads = module.__dict__.get("_sh_reads")
    if reads is not None and not torch.compiler.is_compiling():  # eager, inside the module's forward
        if name not in reads:
            rt, block = registry.decode(module._sh_block_tok)
            reads[name] = rt.eager.stack(rt.layer_at(block, position), dtype, module.__dict__.get("_sh_routed"),
                                         forward_memo=reads)
        w = reads[name]
    else:
        guard_on_runtime(module._sh_runtime_key)
        w = torch.ops.stagehand.streamed_experts(module._sh_block_tok, position, list(shape), dtype, module._sh_device)
    for wrapper in module.__dict__.get("_sh_lora", {}).get(name, ()):  # peft target_parameters (experts/lora.py)
        w = wrapper.adapted(w)
    return w


def attach_streamed(spec, layer_id: int, anchor: torch.Tensor, on_requires_grad, block_tok: torch.Tensor,
                    position: int, device: torch.device, runtime_id: int) -> None:
    """Swap the class of the module that holds `spec`'s weight (a Linear, or an expert stack's module)."""
    if not spec.experts:
        make_streamed(spec.module, layer_id, spec.fqn, anchor, on_requires_grad, block_tok, position,
                      spec.out_features, runtime_id)
        return
    module, name = spec.module, spec.param
    stacks = {**getattr(module, "_sh_stacks", {}), name: (position, tuple(spec.weight.shape), spec.weight.dtype)}
    names = tuple(n for n in module._parameters if n in stacks)
    module.__class__ = streamed_experts_class(getattr(module, "_sh_original_class", type(module)), names, _read_stack)
    module._sh_stacks = stacks
    if not hasattr(module, "_sh_layer"):
        module._sh_layer, module._sh_fqn = layer_id, spec.fqn.rpartition(".")[0]
        module._sh_block_tok, module._sh_device, module._sh_trains = block_tok, device, {}
        module._sh_runtime_key = runtime_key(runtime_id)
    weight = spec.weight
    weight.__class__ = HostMasterParameter
    weight._sh_fqn, weight._sh_layer, weight._sh_name = spec.fqn, layer_id, spec.fqn
    module._sh_trains[name] = weight.requires_grad

    def flag_changed(module=module, name=name, weight=weight):
        module._sh_trains[name] = weight.requires_grad
        on_requires_grad()

    weight._sh_on_requires_grad = flag_changed
