"""Pass `annotate_blocks`: tag every node with the block it belongs to.

Streamed-linear nodes know their block from the layer id they carry (looked up
through the runtime, which also refuses a layer of another offloaded model);
every other node finds it through `nn_module_stack`. The module paths Dynamo
records start at the compiled root (`L['self'].model.layers[0]...`), so the
pass first learns the prefix under which the streamed layers' FQNs appear and
matches block FQNs under it.

Sets `node.meta["stagehand_block"]` (int or None) on every node and
`node.meta["stagehand_layer"]` (index in `runtime.layers`) on streamed linears.
"""

from __future__ import annotations

import re

import torch.fx as fx

from ..context import CompileContext, compiler_pass
from ..graph_nodes import is_streamed_linear, layer_id_of

_ROOT = re.compile(r"^L\[['\"][^'\"]+['\"]\]")
_MODULES_ITEM = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")
_ITEM = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")
_GETATTR = re.compile(r"getattr\(([^()]*), ['\"]([^'\"]+)['\"]\)")


def normalize_module_path(path: str) -> str:
    """`L['self'].layers[0]._modules['mlp']` -> `layers.0.mlp`."""
    previous = None
    while previous != path:
        previous, path = path, _GETATTR.sub(r"\1.\2", path)
    path = _ROOT.sub("", path)
    path = _MODULES_ITEM.sub(r".\1", path)
    path = _ITEM.sub(r".\1", path)
    return path.strip(".")


@compiler_pass("annotate_blocks")
def annotate_blocks(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    rt = ctx.runtime
    block_index = {fqn: i for i, fqn in enumerate(rt.blocks)}
    prefixes: set[str] = set()
    streamed = 0
    for node in gm.graph.nodes:
        if is_streamed_linear(node):
            index = rt.layer_index(layer_id_of(node))
            spec = rt.layers[index]
            node.meta["stagehand_layer"] = index
            node.meta["stagehand_block"] = spec.block
            streamed += 1
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                path = normalize_module_path(list(stack.values())[-1][0])
                if path == spec.fqn or path.endswith("." + spec.fqn):
                    prefixes.add(path[: len(path) - len(spec.fqn)].rstrip("."))
    tagged = 0
    for node in gm.graph.nodes:
        if "stagehand_block" in node.meta:
            continue
        node.meta["stagehand_block"] = _block_from_stack(node, prefixes, block_index)
        tagged += node.meta["stagehand_block"] is not None
    ctx.note(f"{streamed} streamed linears; tagged {tagged} other nodes with their block "
             f"(module-path prefixes {sorted(prefixes)})")
    return gm


def _block_from_stack(node: fx.Node, prefixes: set[str], block_index: dict[str, int]) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    for path, _cls in stack.values():
        path = normalize_module_path(path)
        for prefix in prefixes or {""}:
            if prefix:
                if not (path == prefix or path.startswith(prefix + ".")):
                    continue
                path = path[len(prefix) + 1 :]
            parts = path.split(".")
            for i in range(1, len(parts) + 1):
                found = block_index.get(".".join(parts[:i]))
                if found is not None:
                    return found
    return None
