"""Pass `inline_checkpoints`: a model's own activation checkpoints become block recompute. Dynamo captures
`torch.utils.checkpoint.checkpoint` as `tag_activation_checkpoint(body, *operands)`, opaque to the partition. This
pass copies a body that streams into the graph in place of the call and marks the copies `stagehand_recompute`: the
block unit that owns them recomputes (compiler/recompute.py). A selective policy (`context_fn`) becomes a whole-block
recompute (noted). A call whose outputs are used other than by indexing is left as it is, warned: it runs the eager
op path."""

from __future__ import annotations

import operator
import warnings

import torch.fx as fx
from torch._higher_order_ops.wrap import tag_activation_checkpoint

from torch_stagehand.runtime.runtime import EagerFallbackWarning

from torch_stagehand.compiler.context import CompileContext, compiler_pass
from torch_stagehand.compiler.graph_nodes import RECOMPUTE, attr_at, streams

CHECKPOINT_OPS = (tag_activation_checkpoint,)  # torch.ops.higher_order's, as Dynamo captures it


def is_checkpoint(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in CHECKPOINT_OPS


def _inline(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule) -> None:
    graph = gm.graph
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    operands = list(node.args[1:])
    if len(operands) != len(placeholders):
        raise RuntimeError(f"stagehand: checkpoint {node.name} passes {len(operands)} operands to a body with "
                           f"{len(placeholders)} inputs")
    val_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, operands))
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                result = fx.node.map_arg(inner.args[0], lambda n: val_map[n])
                break
            if inner.op == "get_attr":
                # The body's constants and nested subgraphs move to the outer module.
                attr = f"{node.name}_{inner.target.replace('.', '_')}"
                setattr(gm, attr, attr_at(body, inner.target))
                copied = graph.get_attr(attr)
                copied.meta = dict(inner.meta)
            else:
                copied = graph.node_copy(inner, lambda n: val_map[n])
            copied.meta[RECOMPUTE] = True
            val_map[inner] = copied
    results = result if isinstance(result, (tuple, list)) else (result,)
    for user in list(node.users):
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


@compiler_pass("inline_checkpoints")
def inline_checkpoints(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    inlined, kept, notes, seen = 0, [], [], set()
    while True:  # a checkpoint nested in a body is copied in by the outer one's inlining, then inlined in turn
        pending = [n for n in gm.graph.nodes if is_checkpoint(n) and n not in seen]
        if not pending:
            break
        for node in pending:
            seen.add(node)
            inlined += _inline_one(gm, node, kept, notes)
    if inlined or kept:
        gm.graph.lint()
        gm.recompile()
    ctx.note(f"{inlined} checkpointed regions inlined as block recompute"
             + (f"; left to the eager op path: {'; '.join(kept)}" if kept else ""))
    for note in notes:
        ctx.note(note)
    for reason in kept:
        warnings.warn(f"stagehand: activation checkpoint {reason}: its streamed linears will run the eager op path "
                      "(correct, slower; counted in stats()['eager_linear_calls'])", EagerFallbackWarning, stacklevel=2)
    return gm


def _inline_one(gm: fx.GraphModule, node: fx.Node, kept: list[str], notes: list[str]) -> int:
    """Inline one checkpoint call if its body streams and it can be placed; 1 if it was."""
    body_node = node.args[0]
    body = attr_at(gm, body_node.target) if isinstance(body_node, fx.Node) else None
    if not isinstance(body, fx.GraphModule) or streams(body) is None:
        return 0
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
            kept.append(f"{node.name}: its result is used by {user.format_node()} (only indexing is placed)")
            return 0
    if node.kwargs.get("context_fn") is not None:
        notes.append(f"{node.name}: its selective checkpoint policy (context_fn) became a whole-block recompute")
    _inline(gm, node, body)
    if not body_node.users:
        gm.graph.erase_node(body_node)
        if "." not in body_node.target and hasattr(gm, body_node.target):
            delattr(gm, body_node.target)
    return 1
