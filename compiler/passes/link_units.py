"""Pass `link_units`: each segment submodule becomes a unit, and blocks get their tokens.

After `split_segments` the outer graph calls `submod_<i>` in order. This pass
replaces each submodule by a `GlueUnit` (no streamed weights: compiled as it
is) or a `BlockUnit` (compiled per precision, lazily, see units.py) and
threads the schedule's tokens through the outer graph:

- one `get_attr` per block token (and the no-block token), read at the top;
- each block unit is called as `unit(*inputs, fetch_tok, block_tok, next_tok, prev_tok)`
  where `fetch_tok` is the previous block unit's `prefetch(next)` output when
  it prefetched this block, else a `prefetch` issued just before the call
  (the first block of a graph);
- block units return `(*outputs, next_fetch)`: the users of the outputs are
  rewired through `getitem`.

"next" and "previous" come from the conductor's `FetchOrder` (the one owner of
fetch order): the neighbouring streaming units in the order this graph runs
them, or the neighbouring blocks in model order at the graph's ends (a graph
break still prefetches across it). The block tokens are the graph's own inputs
(each streamed Linear holds its block's), so a graph Dynamo reuses for another
block of the same structure runs that block: the ends are asked per call
(`fetch_order.edge_token`), from the block the caller's token names.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from torch_stagehand.runtime import registry
from torch_stagehand.runtime.conductor import FetchOrder
from torch_stagehand.runtime.conductor.fetch_order import edge_token
from torch_stagehand.runtime.ops import SCHEDULE_OPS

from torch_stagehand.compiler.context import CompileContext, compiler_pass
from torch_stagehand.compiler.graph_nodes import is_streamed_read
from torch_stagehand.compiler.units import BlockUnit, GlueUnit
from torch_stagehand.compiler.passes.assign_segments import Segment


class _Tokens:
    """The outer graph's node for each block token: the graph's own token input where it has one (a graph
    serves every block of its structure, so the block is the caller's), else a get_attr read at the top."""

    def __init__(self, outer: fx.GraphModule, ctx: CompileContext):
        self.outer, self.rt, self.nodes = outer, ctx.runtime, {}
        placeholders = {n.name: n for n in outer.graph.nodes if n.op == "placeholder"}
        for name, (_rt, block) in ctx.tokens.items():
            if name in placeholders:
                self.nodes.setdefault(block, placeholders[name])
        self.inputs = dict(self.nodes)  # block -> its token input
        self.anchor = list(placeholders.values())[-1] if placeholders else None

    def __getitem__(self, block: int) -> fx.Node:
        if block not in self.nodes:
            name = "stagehand_no_block" if block == registry.NO_BLOCK else f"stagehand_block_tok_{block}"
            token = self.rt.no_block_token if block == registry.NO_BLOCK else self.rt.block_tokens[block]
            self.outer.register_buffer(name, token, persistent=False)
            graph = self.outer.graph
            where = graph.inserting_after(self.anchor) if self.anchor else graph.inserting_before(next(iter(graph.nodes)))
            with where:
                self.nodes[block] = self.anchor = graph.get_attr(name)
        return self.nodes[block]

    def edge(self, call: fx.Node, block: int, neighbour: int, step: int, blocks: list[int]) -> fx.Node:
        """The token to fetch at the graph's end beside `block` (`step`: +1 forward, -1 backward): asked at each
        call when the block's token is an input, fixed here otherwise."""
        if block not in self.inputs:
            return self[neighbour]
        present = tuple(self[b] for b in dict.fromkeys(blocks))
        with self.outer.graph.inserting_before(call):
            return self.outer.graph.call_function(edge_token, (self.inputs[block], step, present))


@compiler_pass("link_units")
def link_units(outer: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    rt, graph, segments = ctx.runtime, outer.graph, ctx.segments
    n_blocks = len(rt.blocks)
    calls = {n.target: n for n in graph.nodes if n.op == "call_module"}
    streaming = [s for s in segments if s.block is not None and has_streamed_linear(s)]
    tokens = _Tokens(outer, ctx)
    blocks = [s.block for s in streaming]
    order = FetchOrder.for_graph(blocks, n_blocks)
    previous_next: tuple[int, fx.Node] | None = None  # (block the last unit prefetched, its token node)
    for seg in segments:
        call = calls[seg.name]
        template = outer.get_submodule(seg.name)
        outer.delete_submodule(seg.name)
        is_block = seg in streaming
        name = f"block_{seg.block}_{seg.index}" if is_block else f"glue_{seg.index}"
        unit = (BlockUnit if is_block else GlueUnit)(template, ctx, seg, name)
        outer.add_submodule(name, unit)
        call.target = name
        if not is_block:
            continue
        i = streaming.index(seg)
        b = seg.block
        block_tok = tokens[b]
        nxt = tokens[order[i].next_fwd] if i < len(streaming) - 1 else tokens.edge(call, b, order[i].next_fwd, +1, blocks)
        prev = tokens[order[i].next_bwd] if i > 0 else tokens.edge(call, b, order[i].next_bwd, -1, blocks)
        if previous_next is not None and previous_next[0] == b:
            fetch = previous_next[1]
        else:  # first block of this graph: nothing fetched it ahead
            with graph.inserting_before(call):
                fetch = graph.call_function(SCHEDULE_OPS["prefetch"], (block_tok, []))
        call.args = tuple(call.args) + (fetch, block_tok, nxt, prev)
        previous_next = (order[i].next_fwd, _split_outputs(graph, call, unit.returns_tuple, len(_outputs(template))))
    graph.lint()
    outer.recompile()
    ctx.note(f"{len(streaming)} block units, {len(segments) - len(streaming)} glue units"
             + (f"; the block tokens are graph inputs (the graph serves every block of its structure)"
                if tokens.inputs else ""))
    return outer


def has_streamed_linear(segment: Segment) -> bool:
    return any(is_streamed_read(n) for n in segment.nodes)


def _outputs(template: fx.GraphModule) -> tuple:
    output = next(n for n in template.graph.nodes if n.op == "output")
    return tuple(output.args[0])


def _split_outputs(graph: fx.Graph, call: fx.Node, returned_tuple: bool, n_outputs: int) -> fx.Node:
    """Block units return (*outputs, next_fetch): rewire users, return the token node."""
    with graph.inserting_after(call):
        next_fetch = graph.call_function(operator.getitem, (call, n_outputs))
    if not returned_tuple:
        with graph.inserting_after(call):
            first = graph.call_function(operator.getitem, (call, 0))
        for user in list(call.users):
            if user is not first and user is not next_fetch:
                user.replace_input_with(call, first)
    return next_fetch
