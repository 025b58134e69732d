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

A layer whose weight trains (full fine-tuning; `ctx.trainable` holds its position
in the block) gets `grad_tap(y, x, anchor, block_tok, position)` after its linear:
the identity forward, and in backward the grad-weight GEMM beside the grad-input,
its result sent to the weight's host gradient buffer (runtime/grads.py). The
anchor is the block's grad anchor, which the captured `streamed_linear` takes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.precision import LayerLayout
from torch_stagehand.runtime.experts import expert_weights_from_slot
from torch_stagehand.runtime.ops import SCHEDULE_OPS, grad_tap

from ..context import VariantContext, compiler_pass
from ..graph_nodes import (add_placeholder, example_value, has_static_shape, is_streamed_experts, is_streamed_linear,
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
    rewritten = in_graph = tapped = stacks = 0
    for node in list(gm.graph.nodes):
        if is_streamed_experts(node):
            _rewrite_experts(gm, node, ctx, weights)
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
        # caches refuse a method call on a node without one, compiler/compile_cache.py).
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
             + (f"; {stacks} expert stacks read from the slot" if stacks else ""))
    return gm


def _rewrite_experts(gm: fx.GraphModule, node: fx.Node, ctx: VariantContext, weights: fx.Node) -> None:
    """`streamed_experts(block_tok, position, shape, dtype, device)` -> `expert_weights_from_slot(weights,
    layout, shape, dtype)`: the stack as views of the slot (or their dequantization), traced into the graph.
    Streamed experts are frozen (runtime/experts.py refuses a training forward otherwise): no grad tap."""
    rt = ctx.runtime
    position, shape, dtype = (streamed_arg(node, name) for name in ("position", "shape", "dtype"))
    layout = rt.layer_layout(rt.layer_at(ctx.block, position), ctx.precision)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(expert_weights_from_slot, (weights, layout, list(shape), dtype))
    new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    new.meta["stagehand_precision"] = ctx.precision
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
