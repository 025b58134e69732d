"""Pass `annotate_blocks`: tag every node with the block it belongs to (`node.meta["stagehand_block"]`, int or None;
streamed reads also get `node.meta["stagehand_layer"]`, their index in `runtime.layers`).

A streamed read knows its block from its block token (`ctx.tokens`; another offloaded model's is refused); every
other node finds it through `nn_module_stack`, whose paths start at the compiled root: the pass learns the prefix
under which the streamed layers' FQNs appear. When the compiled root is a block (`compile_blocks`), every node
belongs to it.
"""

from __future__ import annotations

import torch.fx as fx

from torch_stagehand.compiler.context import CompileContext, compiler_pass
from torch_stagehand.compiler.graph_nodes import (
    is_streamed_experts, is_streamed_read, normalize_module_path, streamed_arg)


@compiler_pass("annotate_blocks")
def annotate_blocks(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    rt = ctx.runtime
    block_index = {fqn: i for i, fqn in enumerate(rt.blocks)}
    prefixes: set[str] = set()
    # FQN heads the recorded paths lack (a checkpoint body records paths from the module that called it).
    heads: set[str] = set()
    roots: set[int] = set()  # blocks that are the compiled root (their layers' paths are FQN suffixes)
    streamed = 0
    for node in gm.graph.nodes:
        if not is_streamed_read(node):
            continue
        block = _block_of_token(node, ctx)
        node.meta["stagehand_layer"] = index = rt.layer_at(block, streamed_arg(node, "position"))
        streamed += 1
        if is_streamed_experts(node):  # an expert stack's path is its module's: its block is its token's
            node.meta["stagehand_block"] = block
            continue
        spec = rt.layers[index]
        node.meta["stagehand_block"] = spec.block
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            path = normalize_module_path(list(stack.values())[-1][0])
            if path == spec.fqn or path.endswith("." + spec.fqn):
                prefixes.add(path[: len(path) - len(spec.fqn)].rstrip("."))
            elif spec.fqn.endswith("." + path) and spec.fqn[: -len(path) - 1] == rt.blocks[spec.block]:
                roots.add(spec.block)
            elif spec.fqn.endswith("." + path):
                heads.add(spec.fqn[: -len(path) - 1])
    root = next(iter(roots)) if len(roots) == 1 and not prefixes and not heads else None
    tagged = 0
    for node in gm.graph.nodes:
        if "stagehand_block" in node.meta:
            continue
        if root is not None:  # the graph is the block's forward: all of its code is the block's
            node.meta["stagehand_block"] = root if node.op not in ("placeholder", "output") else None
        else:
            node.meta["stagehand_block"] = _block_from_stack(node, prefixes, block_index, heads)
        tagged += node.meta["stagehand_block"] is not None
    where = (f"the compiled root is block {root} ({rt.blocks[root]})" if root is not None
             else f"module-path prefixes {sorted(prefixes)}" + (f", FQN heads {sorted(heads)}" if heads else ""))
    ctx.note(f"{streamed} streamed linears; tagged {tagged} other nodes with their block ({where})")
    return gm


def _block_of_token(node: fx.Node, ctx: CompileContext) -> int:
    """The block whose token the streamed read takes; refuses a token of another offloaded model."""
    token = streamed_arg(node, "block_tok")
    owner = ctx.tokens.get(token.name) if isinstance(token, fx.Node) else None
    if owner is None:
        raise RuntimeError(f"stagehand: the streamed linear {node.name} takes {token!r} as its block token, which is "
                           "not a block token of a live offloaded model (was the model restored?)")
    if owner[0] is not ctx.runtime:
        raise RuntimeError("stagehand: one compiled graph streams layers of two different offloaded models")
    return owner[1]


def _block_from_stack(node: fx.Node, prefixes: set[str], block_index: dict[str, int],
                      heads: set[str] = frozenset()) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    for path, _cls in stack.values():
        path = normalize_module_path(path)
        for prefix in prefixes or {""}:
            if prefix:
                if not (path == prefix or path.startswith(prefix + ".")):
                    continue
                path = path[len(prefix) + 1 :]
            for head in ("", *heads):
                parts = (f"{head}.{path}" if head else path).split(".")
                for i in range(1, len(parts) + 1):
                    found = block_index.get(".".join(parts[:i]))
                    if found is not None:
                        return found
    return None
