"""The parts of a block variant's cache key (units.py): what its graph computes, and its inputs."""

from __future__ import annotations

import hashlib

import torch.fx as fx

from torch_stagehand.compiler.symbolic import input_key


def structure_key(gm: fx.GraphModule) -> str:
    """A hash of what the graph computes, blind to node names."""
    index: dict[fx.Node, str] = {}
    parts = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = f"%{i}"
        target = node.target
        if node.op == "get_attr":
            target = f"{target}@{id(getattr(gm, target, None))}"  # a constant shares only with itself
        elif node.op == "placeholder":
            target = ""
        elif not isinstance(target, str):
            target = getattr(target, "__module__", "") + "." + getattr(target, "__qualname__", str(target))
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        parts.append((node.op, target, repr(args)))
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def input_signature(args: tuple, grad: bool = True) -> tuple:
    """The input part of a static variant's key: every tensor's exact shape and strides (and, with grad on,
    its grad flag: symbolic.input_key)."""
    return tuple(input_key(a, exact_sizes=True, grad=grad) for a in args)
