"""Pass `link_units`: each segment submodule becomes a unit, and blocks get their tokens. Each `submod_<i>` becomes a
`GlueUnit` or a `BlockUnit` (units.py), called as `unit(*inputs, fetch_tok, block_tok, next_tok, prev_tok)` and
returning `(*outputs, next_fetch)`; `fetch_tok` is the previous block unit's prefetch of this block, else a prefetch
just before the call. "next" and "previous" come from the conductor's `FetchOrder`, asked per call at the graph's
ends where the block tokens are inputs."""

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


class _Tokens:
    """The outer graph's node for each block token: the graph's own token input, else a get_attr at the top."""

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
            with graph.inserting_after(self.anchor) if self.anchor else graph.inserting_before(next(iter(graph.nodes))):
                self.nodes[block] = self.anchor = graph.get_attr(name)
        return self.nodes[block]

    def edge(self, call: fx.Node, block: int, neighbour: int, step: int, blocks: list[int]) -> fx.Node:
        """The token to fetch at the graph's end beside `block` (`step`: +1 forward, -1 backward); asked per call
        when the block's token is an input."""
        if block not in self.inputs:
            return self[neighbour]
        present = tuple(self[b] for b in dict.fromkeys(blocks))
        with self.outer.graph.inserting_before(call):
            return self.outer.graph.call_function(edge_token, (self.inputs[block], step, present))


@compiler_pass("link_units")
def link_units(outer: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    graph, segments = outer.graph, ctx.segments
    calls = {n.target: n for n in graph.nodes if n.op == "call_module"}
    streaming = [s for s in segments if s.block is not None and any(is_streamed_read(n) for n in s.nodes)]
    tokens = _Tokens(outer, ctx)
    blocks = [s.block for s in streaming]
    order = FetchOrder.for_graph(blocks, len(ctx.runtime.blocks))
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
        i, b = streaming.index(seg), seg.block
        block_tok, fwd, bwd = tokens[b], order[i].next_fwd, order[i].next_bwd
        nxt = tokens[fwd] if i < len(streaming) - 1 else tokens.edge(call, b, fwd, +1, blocks)
        prev = tokens[bwd] if i > 0 else tokens.edge(call, b, bwd, -1, blocks)
        if previous_next is not None and previous_next[0] == b:
            fetch = previous_next[1]
        else:  # first block of this graph: nothing fetched it ahead
            with graph.inserting_before(call):
                fetch = graph.call_function(SCHEDULE_OPS["prefetch"], (block_tok, []))
        call.args = tuple(call.args) + (fetch, block_tok, nxt, prev)
        outputs = next(n for n in template.graph.nodes if n.op == "output").args[0]
        previous_next = (fwd, _split_outputs(graph, call, unit.returns_tuple, len(outputs)))
    graph.lint()
    outer.recompile()
    ctx.note(f"{len(streaming)} block units, {len(segments) - len(streaming)} glue units"
             + ("; the block tokens are graph inputs (the graph serves every block of its structure)"
                if tokens.inputs else ""))
    return outer


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
