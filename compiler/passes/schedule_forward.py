"""Pass `schedule`: prefetch / wait / evict nodes and their transfer tokens.

Forward (per block graph, after rewrite_linear):

    slot       = wait(fetch_tok, block_tok, nbytes, precision)   # replaces `weights`
    next_fetch = prefetch(next_tok, after=[slot])                # H2D of the next block overlaps this one
    ...        = linear(x, slot, ...)                            # every read depends on the wait
    free       = evict(block_tok, slot, readers=[...])           # after the last reader
    return (*outputs, next_fetch)                                # next block's graph waits on it

Backward (`schedule_backward`, a joint-graph pass so the partitioned backward
graph that compiled autograd copies holds it): each `linear`'s backward
formula asked for its block with `wait_bw` and prefetched the previous block;
this pass keeps one `wait_bw` and one `prefetch` per block and closes the
block's backward with an `evict` after its last reader.

The plan here is the simple one (fetch the next block while this computes;
the device-slot cache keeps the last forward block resident across the
forward/backward turn); the Conductor's placement rules plug in here later.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from torch_stagehand.runtime.host_store import KIND_CODES
from torch_stagehand.runtime.ops import SCHEDULE_OPS

from .context import CompileContext
from .rewrite_linear import BLOCK_TOK, WEIGHTS, add_placeholder

FETCH_TOK, NEXT_TOK = "stagehand_fetch_tok", "stagehand_next_tok"
TOKEN_INPUTS = (FETCH_TOK, BLOCK_TOK, NEXT_TOK, "stagehand_prev_tok")


def _placeholder(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name)


def order_token_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """Put the token placeholders last, in TOKEN_INPUTS order (the unit's calling convention)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    last = placeholders[-1]
    for name in TOKEN_INPUTS:
        node = _placeholder(gm, name)
        if node is not last:
            last.append(node)
        last = node
    return gm


def schedule_forward(gm: fx.GraphModule, ctx: CompileContext, block: int, precision: str) -> fx.GraphModule:
    rt, graph = ctx.runtime, gm.graph
    weights = _placeholder(gm, WEIGHTS)
    block_tok = _placeholder(gm, BLOCK_TOK)
    fetch_tok = add_placeholder(gm, FETCH_TOK)
    next_tok = add_placeholder(gm, NEXT_TOK)
    nbytes, code = rt.block_nbytes(block, precision), KIND_CODES[precision]
    with graph.inserting_after(next_tok):
        slot = graph.call_function(SCHEDULE_OPS["wait"], (fetch_tok, block_tok, nbytes, code, ctx.device))
    with graph.inserting_after(slot):
        next_fetch = graph.call_function(SCHEDULE_OPS["prefetch"], (next_tok, [slot]))
    weights.replace_all_uses_with(slot)
    graph.erase_node(weights)
    readers = [u for u in slot.users if u is not next_fetch]
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        graph.call_function(SCHEDULE_OPS["evict"], (block_tok, slot, readers, code))
    results = output.args[0]
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    output.args = (results + (next_fetch,),)
    order_token_inputs(gm)
    graph.lint()
    gm.recompile()
    ctx.note("schedule", f"block {block}: wait + prefetch(next) + evict after {len(readers)} readers, {nbytes} B {precision}")
    return gm


def schedule_backward(graph: fx.Graph) -> fx.Graph:
    """Joint-graph pass: one wait_bw / prefetch per block, and an evict after the last reader."""
    wait_bw, prefetch, evict = SCHEDULE_OPS["wait_bw"], SCHEDULE_OPS["prefetch"], SCHEDULE_OPS["evict"]
    kept: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is wait_bw:
            key = (node.args[0], node.args[2], node.args[3])  # block token, nbytes, precision
            if key in kept:
                node.replace_all_uses_with(kept[key])
                graph.erase_node(node)
            else:
                kept[key] = node
    if not kept:
        return graph
    slots = set(kept.values())
    seen_prefetch: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is prefetch and any(a in slots for a in node.args[1]):
            if node.args[0] in seen_prefetch and not node.users:
                graph.erase_node(node)
            else:
                seen_prefetch.add(node.args[0])
    position = {n: i for i, n in enumerate(graph.nodes)}
    for (block_tok, _nbytes, code), slot in kept.items():
        readers = [u for u in slot.users if u.target is not prefetch]
        last = max(readers, key=position.__getitem__)
        with graph.inserting_after(last):
            node = graph.call_function(evict, (block_tok, slot, readers, code))
        _set_fake_token_meta(node, slot)
    graph.lint()
    return graph


def _set_fake_token_meta(node: fx.Node, like: fx.Node) -> None:
    fake = like.meta.get("val")
    mode = getattr(fake, "fake_mode", None)
    if isinstance(mode, FakeTensorMode):
        with mode:
            node.meta["val"] = torch.empty((), dtype=torch.int64)
