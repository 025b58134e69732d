"""The `stagehand` torch.compile backend.

    torch.compile(model, backend="stagehand", options={"inner": "eager"})

Pass order on each Dynamo graph:

1. `annotate_blocks` (partition.py): node -> block, streamed linear -> layer.
2. `assign_segments` + `segment_dag` (partition.py): contiguous block / glue
   runs and their DAG (networkx).
3. `split` (partition.py): one submodule per segment under an outer graph.
4. `link_units` (here): each submodule becomes a GlueUnit or a BlockUnit, and
   the outer graph gets the block tokens and the cross-block transfer tokens
   (block k's `prefetch(next)` output feeds block k+1's `wait`).
5. Per block unit and precision, lazily: `rewrite_linear`, `schedule`
   (forward), the inner compiler with `schedule_backward` on the joint graph.

The outer graph runs as plain Python (like DDPOptimizer's stitching graph);
all tensor work happens inside the compiled units.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import networkx as nx
import torch.fx as fx

from torch_stagehand.runtime import registry
from torch_stagehand.runtime.ops import SCHEDULE_OPS

from .context import BackendOptions, CompileContext
from .inner import compile_unit
from .partition import Segment, annotate_blocks, assign_segments, is_streamed_linear, segment_dag, split
from .units import BlockUnit, GlueUnit, has_streamed_linear

log = logging.getLogger("torch_stagehand.compiler")
_graph_ids = itertools.count()


@dataclass
class GraphRecord:
    """What the backend did to one Dynamo graph (explain reads these)."""

    graph_id: int
    segments: list[Segment]
    dag: nx.DiGraph
    outer: fx.GraphModule
    changes: list[str] = field(default_factory=list)


def _runtime_of(gm: fx.GraphModule):
    for node in gm.graph.nodes:
        if is_streamed_linear(node):
            return registry.layer(node.args[2] if len(node.args) > 2 else node.kwargs["layer"])[0]
    return None


def stagehand_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None):
    opts = BackendOptions.from_dict(options)
    rt = _runtime_of(gm)
    if rt is None:
        # Nothing streams in this graph (e.g. a graph break left only glue): compile it plainly.
        log.info("stagehand: graph has no streamed layers; compiling it with %s alone", opts.inner)
        return compile_unit(gm, list(example_inputs), opts.inner, lambda *_: None)
    ctx = CompileContext(rt, opts, graph_id=next(_graph_ids))
    gm = annotate_blocks(gm, ctx)
    segments = assign_segments(gm, ctx)
    dag = segment_dag(gm, segments)
    outer = split(gm, segments)
    outer = link_units(outer, segments, ctx)
    rt.graph_records.append(GraphRecord(ctx.graph_id, segments, dag, outer, ctx.changes))
    return outer


class _Tokens:
    """One get_attr node per block token, read at the top of the outer graph."""

    def __init__(self, outer: fx.GraphModule, rt):
        self.outer, self.rt, self.nodes = outer, rt, {}
        placeholders = [n for n in outer.graph.nodes if n.op == "placeholder"]
        self.anchor = placeholders[-1] if placeholders else None

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


def link_units(outer: fx.GraphModule, segments: list[Segment], ctx: CompileContext) -> fx.GraphModule:
    rt, graph = ctx.runtime, outer.graph
    n_blocks = len(rt.blocks)
    calls = {n.target: n for n in graph.nodes if n.op == "call_module"}
    streaming = [s for s in segments if s.block is not None and has_streamed_linear(s)]
    tokens = _Tokens(outer, rt)
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
        nxt = streaming[i + 1].block if i + 1 < len(streaming) else (b + 1 if b + 1 < n_blocks else registry.NO_BLOCK)
        prev = streaming[i - 1].block if i > 0 else (b - 1 if b > 0 else registry.NO_BLOCK)
        block_tok, next_tok, prev_tok = tokens[b], tokens[nxt], tokens[prev]
        if previous_next is not None and previous_next[0] == b:
            fetch = previous_next[1]
        else:  # first block of this graph: nothing fetched it ahead
            with graph.inserting_before(call):
                fetch = graph.call_function(SCHEDULE_OPS["prefetch"], (block_tok, []))
        call.args = tuple(call.args) + (fetch, block_tok, next_tok, prev_tok)
        previous_next = (nxt, _split_outputs(graph, call, unit.returns_tuple, len(_outputs(template))))
    graph.lint()
    outer.recompile()
    ctx.note("link_units", f"{len(streaming)} block units, {len(segments) - len(streaming)} glue units")
    return outer


def _outputs(template: fx.GraphModule) -> tuple:
    output = next(n for n in template.graph.nodes if n.op == "output")
    return tuple(output.args[0])


def _split_outputs(graph: fx.Graph, call: fx.Node, returned_tuple: bool, n_outputs: int) -> fx.Node:
    """Block units return (*outputs, next_fetch): rewire users, return the token node."""
    import operator

    with graph.inserting_after(call):
        next_fetch = graph.call_function(operator.getitem, (call, n_outputs))
    if not returned_tuple:
        with graph.inserting_after(call):
            first = graph.call_function(operator.getitem, (call, 0))
        for user in list(call.users):
            if user is not first and user is not next_fetch:
                user.replace_input_with(call, first)
    return next_fetch
