"""Pass `rewrite_linear` (per variant): streamed reads become reads of the block's slot. `streamed_linear(x, bias,
block_tok, position, out_features, anchor)` becomes `stagehand.linear(x, weights, bias, block_tok, prev_tok,
layout)`: `weights` is a new placeholder for the block's device bytes (fed by `schedule_forward`) and `layout` places
the layer in them, so every block of one structure and layout gives one graph. A precision whose GEMM cannot add the
bias (`bias_in_graph`) gets the add in the graph; one with a `graph_linear` is traced in as graph ops (unless
`linear_math="op"`). An expert stack becomes `expert_weights_from_slot`, or, for a one-byte stack read only by
grouped GEMMs, each GEMM `grouped_experts_from_slot` (`experts_math`). A layer whose weight trains gets a `grad_tap`
(runtime/train/grads.py)."""

from __future__ import annotations

import torch
import torch.fx as fx

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.precision import LayerLayout
from torch_stagehand.runtime.experts.stacks import expert_weights_from_slot, grouped_experts_from_slot
from torch_stagehand.runtime.ops import SCHEDULE_OPS, grad_tap

from torch_stagehand.compiler.context import VariantContext, compiler_pass
from torch_stagehand.compiler.graph_nodes import (
    add_placeholder, example_value, has_static_shape, is_streamed_experts, is_streamed_linear, node_arg, streamed_arg)

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
    weights, block_tok, prev_tok = (add_placeholder(gm, name) for name in (WEIGHTS, BLOCK_TOK, PREV_TOK))
    rewritten = in_graph = tapped = stacks = grouped = 0
    for node in list(gm.graph.nodes):
        if is_streamed_experts(node):
            grouped += _rewrite_experts(gm, node, ctx, weights)
            stacks += 1
            continue
        if not is_streamed_linear(node):
            continue
        x, bias, anchor = (streamed_arg(node, name) for name in ("x", "bias", "anchor"))
        # The variant's block, not the one Dynamo traced: a graph serves every block of its structure.
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
                new = gm.graph.call_function(SCHEDULE_OPS["linear"],
                                             (x, weights, None if bias_add else bias, block_tok, prev_tok, layout))
            tap = gm.graph.call_function(grad_tap, (new, x, anchor, block_tok, position)) if trains else new
            tapped += trains
            out = gm.graph.call_function(torch.ops.aten.add.Tensor, (tap, bias)) if bias_add else tap
        # Every node standing for the output carries its metadata (example_value: the compile caches need one).
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
    """`streamed_experts(...)` -> the stack read from the slot: for a one-byte stack read only through grouped
    GEMMs, each GEMM `grouped_experts_from_slot`; else `expert_weights_from_slot`. Returns how many GEMMs now
    compute from the bytes. Streamed experts are frozen (runtime/experts/stacks.py): no grad tap."""
    rt = ctx.runtime
    position, shape, dtype = (streamed_arg(node, name) for name in ("position", "shape", "dtype"))
    layout = rt.layer_layout(rt.layer_at(ctx.block, position), ctx.precision)
    gemms = (_grouped_gemms(node) if LayerLayout.from_ints(layout).scale_offset >= 0
             and ctx.parent.options.experts_math == "grouped" else None)
    if not gemms:
        _replace(gm, node, expert_weights_from_slot, (weights, layout, list(shape), dtype), ctx.precision)
        return 0
    for gemm, rows_are_out in gemms:
        args = (gemm.args[0], weights, node_arg(gemm, 2, "offs"), layout, list(shape), rows_are_out)
        _replace(gm, gemm, grouped_experts_from_slot, args, ctx.precision)
    for user in list(node.users):  # the transposes the GEMMs read
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    return len(gemms)


def _replace(gm: fx.GraphModule, old: fx.Node, target, args: tuple, precision: str) -> None:
    """`old` replaced by `target(*args)`, which takes its metadata (not its fake value) and names the precision."""
    with gm.graph.inserting_before(old):
        new = gm.graph.call_function(target, args)
    new.meta.update({k: v for k, v in old.meta.items() if k != "val"})
    new.meta["stagehand_precision"] = precision
    old.replace_all_uses_with(new)
    gm.graph.erase_node(old)


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
    extra = {k: v for k, v in node.kwargs.items() if k != "offs"}
    return (2 <= len(node.args) <= 3 and node.args[1] is weight and node.args[0] is not weight
            and isinstance(node_arg(node, 2, "offs"), fx.Node) and all(v is None for v in extra.values()))


def _swaps_last_two(node: fx.Node, stack: fx.Node) -> bool:
    """`stack.transpose(-2, -1)` (or (1, 2), torch.transpose) of a 3-D stack."""
    transpose = ((node.op == "call_method" and node.target == "transpose")
                 or (node.op == "call_function" and node.target is torch.transpose))
    return (transpose and len(node.args) == 3 and node.args[0] is stack and not node.kwargs
            and {d % 3 for d in node.args[1:] if isinstance(d, int)} == {1, 2})


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
