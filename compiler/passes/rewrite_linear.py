"""Pass `rewrite_linear`: streamed Linears become `stagehand::linear` on a weight token.

Before: `y = streamed_linear(x, bias, block_tok, position, out_features, anchor)` (what Dynamo captured).
After:  `y = stagehand.linear(x, weights, bias, block_tok, prev_tok, layout)`
where `weights` is a new placeholder standing for the block's device bytes in
the chosen precision and `layout` says where this layer sits in them (offsets,
shape, dtype or INT8 + scale). Nothing in the graph names one block, so
every block with the same structure and layout produces the same graph and
shares one compiled variant. `schedule_forward` later feeds `weights` from a
`wait`. A per-variant pass: the block and precision come from a `VariantContext`.

A precision whose GEMM cannot add the bias in its epilogue (`bias_in_graph`: fp8)
gets `stagehand.linear(x, weights, None, ...) + bias` instead, so Inductor fuses
the add into the op that reads the output next (an activation, a residual add).

A precision that can write its math in graph ops (`graph_linear`: fp8 on FP8
tensor cores, int8 at many rows) gets `graph_linear(x, weights, block_tok, prev_tok, layout) + bias`:
a Python call that AOTAutograd traces into aten ops, so Inductor fuses the
activation's quantization and calls the GEMM from its own code, with none of the
op's per-call host work. The backend option `linear_math="op"` keeps the op.

An expert stack (`streamed_experts`) becomes `expert_weights_from_slot`, the stack as views of the slot or
their dequantization; a one-byte stack that the model reads only through grouped GEMMs is not made: each
GEMM becomes `grouped_experts_from_slot`, which multiplies from the bytes (backend option `experts_math`).

A layer whose weight trains (full fine-tuning; `ctx.trainable` holds its position
in the block) gets `grad_tap(y, x, anchor, block_tok, position)` after its linear:
the identity forward, and in backward the grad-weight GEMM beside the grad-input,
its result sent to the weight's host gradient buffer (runtime/train/grads.py). The
anchor is the block's grad anchor, which the captured `streamed_linear` takes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.precision import LayerLayout
from torch_stagehand.runtime.experts.stacks import expert_weights_from_slot, grouped_experts_from_slot
from torch_stagehand.runtime.ops import SCHEDULE_OPS, grad_tap

from torch_stagehand.compiler.context import VariantContext, compiler_pass
from torch_stagehand.compiler.graph_nodes import (add_placeholder, example_value, has_static_shape, is_streamed_experts, is_streamed_linear,
                           streamed_arg)

WEIGHTS, BLOCK_TOK, PREV_TOK = "stagehand_weights", "stagehand_block_tok", "stagehand_prev_tok"


def _rows(x: fx.Node, in_features: int) -> int | None:
    """The rows (tokens) of the Linear's input as captured, or None where they are symbolic or unknown."""
    value = example_value(x)
    if not has_static_shape(value) or not in_features:
        return None
    return value.numel() // in_features


@compiler_pass("rewrite_linear")
def rewrite_linear(gm: fx.GraphModule, ctx: VariantContext) -> fx.GraphModule:
    rt, precision = ctx.runtime, ctx.precision
    weights = add_placeholder(gm, WEIGHTS)
    block_tok = add_placeholder(gm, BLOCK_TOK)
    prev_tok = add_placeholder(gm, PREV_TOK)
    rewritten = in_graph = tapped = stacks = grouped = 0
    for node in list(gm.graph.nodes):
        if is_streamed_experts(node):
            grouped += _rewrite_experts(gm, node, ctx, weights)
            stacks += 1
            continue
        if not is_streamed_linear(node):
            continue
        x, bias, anchor = (streamed_arg(node, name) for name in ("x", "bias", "anchor"))
        # The variant's block (the unit's block at this call), not the one Dynamo traced: a graph serves
        # every block of its structure, and each layout of theirs gets its own variant (units.BlockUnit).
        position = streamed_arg(node, "position")
        trains = position in ctx.trainable and isinstance(anchor, fx.Node)
        layout = rt.layer_layout(rt.layer_at(ctx.block, position), precision)
        entry, lay = precisions.by_code(layout[0]), LayerLayout.from_ints(layout)
        traced = (entry.graph_linear(lay, ctx.device, _rows(x, lay.in_features))
                  if ctx.parent.options.linear_math == "graph" else None)
        bias_add = bias is not None and (traced is not None or entry.bias_in_graph(lay))
        with gm.graph.inserting_before(node):
            if traced is not None:
                new = gm.graph.call_function(traced, (x, weights, block_tok, prev_tok, layout))
                in_graph += 1
            else:
                new = gm.graph.call_function(
                    SCHEDULE_OPS["linear"], (x, weights, None if bias_add else bias, block_tok, prev_tok, layout)
                )
            tap = gm.graph.call_function(grad_tap, (new, x, anchor, block_tok, position)) if trains else new
            tapped += trains
            out = gm.graph.call_function(torch.ops.aten.add.Tensor, (tap, bias)) if bias_add else tap
        # Every node standing for the linear's output carries its metadata (example_value too: the compile
        # caches refuse a method call on a node without one, compiler/startup/compile_cache.py).
        for made in dict.fromkeys((new, tap, out)):
            made.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta["stagehand_precision"] = precision
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        rewritten += 1
    gm.graph.lint()
    gm.recompile()
    ctx.note(f"{rewritten} streamed linears -> stagehand.linear ({precision})"
             + (f", {in_graph} of them as graph ops" if in_graph else "")
             + (f", {tapped} with their weight gradient (full fine-tuning)" if tapped else "")
             + (f"; {stacks} expert stacks read from the slot" if stacks else "")
             + (f", {grouped} grouped GEMMs computing from their bytes" if grouped else ""))
    return gm


def _rewrite_experts(gm: fx.GraphModule, node: fx.Node, ctx: VariantContext, weights: fx.Node) -> int:
    """`streamed_experts(block_tok, position, shape, dtype, device)` -> the stack read from the slot. Returns
    how many of the model's grouped GEMMs now compute from the stack's bytes.

    * A one-byte stack (int8, fp8: its layout has a scale) that the model reads only through grouped GEMMs
      (`_grouped_mm(x, stack.transpose(-2, -1), offs)`, or the stack itself as gpt-oss keeps it): each GEMM
      becomes `grouped_experts_from_slot(x, weights, offs, layout, shape, rows_are_out)`, which multiplies
      from the bytes; no bf16 copy of the stack is made (backend option experts_math="grouped").
    * Otherwise `expert_weights_from_slot(weights, layout, shape, dtype)`: the stack as views of the slot (or
      their dequantization), traced into the graph, read by whatever the model does with it.
    Streamed experts are frozen (runtime/experts/stacks.py refuses a training forward otherwise): no grad tap."""
    rt = ctx.runtime
    position, shape, dtype = (streamed_arg(node, name) for name in ("position", "shape", "dtype"))
    layout = rt.layer_layout(rt.layer_at(ctx.block, position), ctx.precision)
    gemms = (_grouped_gemms(node) if LayerLayout.from_ints(layout).scale_offset >= 0
             and ctx.parent.options.experts_math == "grouped" else None)
    if gemms:
        for gemm, rows_are_out in gemms:
            x, offs = gemm.args[0], gemm.kwargs.get("offs", gemm.args[2] if len(gemm.args) > 2 else None)
            with gm.graph.inserting_before(gemm):
                new = gm.graph.call_function(grouped_experts_from_slot,
                                             (x, weights, offs, layout, list(shape), rows_are_out))
            new.meta.update({k: v for k, v in gemm.meta.items() if k != "val"})
            new.meta["stagehand_precision"] = ctx.precision
            gemm.replace_all_uses_with(new)
            gm.graph.erase_node(gemm)
        for user in list(node.users):  # the transposes the GEMMs read
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        return len(gemms)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(expert_weights_from_slot, (weights, layout, list(shape), dtype))
    new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    new.meta["stagehand_precision"] = ctx.precision
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return 0


def _grouped_gemm_targets() -> tuple:
    found = [torch._grouped_mm, getattr(torch.nn.functional, "grouped_mm", None)]
    # transformers' own op where torch's grouped GEMM cannot take the dtype (its fp32 fallback)
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        found += [fallback, fallback.default]
    return tuple(t for t in found if t is not None)


def _plain_grouped_gemm(node: fx.Node, weight: fx.Node) -> bool:
    """`grouped_mm(x, weight, offs=...)` with `weight` as its second operand, no bias, no output dtype."""
    if node.op != "call_function" or node.target not in _grouped_gemm_targets():
        return False
    args, kwargs = node.args, node.kwargs
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    extra = {k: v for k, v in kwargs.items() if k != "offs"}
    return (len(args) >= 2 and args[1] is weight and args[0] is not weight and isinstance(offs, fx.Node)
            and len(args) <= 3 and all(v is None for v in extra.values()))


def _swaps_last_two(node: fx.Node, stack: fx.Node) -> bool:
    """`stack.transpose(-2, -1)` (or (1, 2), torch.transpose) of a 3-D stack."""
    if not ((node.op == "call_method" and node.target == "transpose")
            or (node.op == "call_function" and node.target is torch.transpose)):
        return False
    if len(node.args) != 3 or node.args[0] is not stack or node.kwargs:
        return False
    dims = {d % 3 for d in node.args[1:] if isinstance(d, int)}
    return dims == {1, 2}


def _grouped_gemms(stack: fx.Node) -> list[tuple[fx.Node, bool]] | None:
    """Every read of `stack`, each a plain grouped GEMM (rows_are_out: through a transpose, [E, out, in]), or
    None where any read is something else (a LoRA delta added, an index, a loop): then the stack is made."""
    found = []
    for user in stack.users:
        if _plain_grouped_gemm(user, stack):
            found.append((user, False))
        elif _swaps_last_two(user, stack) and user.users and all(_plain_grouped_gemm(g, user) for g in user.users):
            found += [(g, True) for g in user.users]
        else:
            return None
    return found or None
