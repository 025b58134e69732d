"""Small FX helpers the passes share: which nodes stream, what a node held when captured, and placeholder plumbing."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from torch_stagehand.runtime.ops import STREAMED_LINEAR_OPS


# Node meta key: the node came from the body of the model's own activation checkpoint
# (set by passes/inline_checkpoints, read by assign_segments: the block recomputes).
RECOMPUTE = "stagehand_recompute"


def example_value(node: Any) -> Any:
    """What the node held when Dynamo captured it (its fake value), or None (not a node, or no record)."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def has_static_shape(value: Any) -> bool:
    """A tensor whose every size is a plain int (no symbolic dimension)."""
    return isinstance(value, torch.Tensor) and all(isinstance(d, int) for d in value.shape)


def is_streamed_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in STREAMED_LINEAR_OPS


def streams(gm: fx.GraphModule) -> fx.Node | None:
    """The first streamed linear of this graph or of a subgraph it calls (a checkpoint body), if any."""
    for node in gm.graph.nodes:
        if is_streamed_linear(node):
            return node
        if node.op == "get_attr":
            sub = getattr(gm, node.target, None)
            found = streams(sub) if isinstance(sub, fx.GraphModule) else None
            if found is not None:
                return found
    return None


def layer_id_of(node: fx.Node) -> int:
    """The global layer id a captured `streamed_linear(x, bias, layer)` node carries."""
    return node.args[2] if len(node.args) > 2 else node.kwargs["layer"]


def add_placeholder(gm: fx.GraphModule, name: str) -> fx.Node:
    """A new input after the last placeholder (inputs keep their order)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where = placeholders[-1] if placeholders else next(iter(gm.graph.nodes))
    with (gm.graph.inserting_after(where) if placeholders else gm.graph.inserting_before(where)):
        return gm.graph.placeholder(name)


def find_placeholder(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name)
