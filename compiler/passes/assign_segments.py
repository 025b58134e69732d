"""Pass `assign_segments`: cut the annotated graph into segments and record their DAG. A segment is a maximal run of
nodes (in graph order) of one block, or of glue; glue inside a block's run joins it, so a block is one unit unless
the code really leaves it. Sets `node.meta["stagehand_segment"]` and records `ctx.segments` and `ctx.dag` (edges
carry the values that cross segments); the graph is unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch.fx as fx

from torch_stagehand.compiler.context import CompileContext, compiler_pass
from torch_stagehand.compiler.graph_nodes import RECOMPUTE, is_streamed_read


@dataclass
class Segment:
    index: int
    block: int | None  # None: glue
    nodes: list[fx.Node] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"submod_{self.index}"

    @property
    def kind(self) -> str:
        return "glue" if self.block is None else "block"

    @property
    def recompute(self) -> bool:
        """Did the model checkpoint this block (nodes inlined from its checkpoint)?"""
        return self.block is not None and any(n.meta.get(RECOMPUTE) for n in self.nodes)


@compiler_pass("assign_segments")
def assign_segments(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    # The block of the next block-owned node at or after each position.
    next_block: list[int | None] = [None] * len(body)
    upcoming = None
    for i in range(len(body) - 1, -1, -1):
        if body[i].meta.get("stagehand_block") is not None:
            upcoming = body[i].meta["stagehand_block"]
        next_block[i] = upcoming
    segments: list[Segment] = []
    for i, node in enumerate(body):
        block = node.meta.get("stagehand_block")
        current = segments[-1] if segments else None
        if block is None and current is not None and current.block is not None and next_block[i] == current.block:
            block = current.block  # glue inside the block's run stays in the block
        if current is None or current.block != block:
            current = Segment(len(segments), block)
            segments.append(current)
        current.nodes.append(node)
        node.meta["stagehand_segment"] = current.index
    counts = [s.block for s in segments if s.block is not None]
    partial = len(counts) - len(set(counts))
    ctx.segments = segments
    ctx.dag = segment_dag(segments)
    ctx.note(f"{len(segments)} segments: {len(counts)} block, {len(segments) - len(counts)} glue"
             + (f", {partial} block(s) split by glue or graph order" if partial else "")
             + f"; {ctx.dag.number_of_edges()} DAG edges")
    return gm


def segment_dag(segments: list[Segment]) -> nx.DiGraph:
    """Segments as a DAG; an edge u->v lists the values u produces that v reads."""
    dag = nx.DiGraph()
    for s in segments:
        dag.add_node(s.index, kind=s.kind, block=s.block, ops=len(s.nodes),
                     streamed=sum(is_streamed_read(n) for n in s.nodes))
    for s in segments:
        for node in s.nodes:
            for user in node.users:
                target = user.meta.get("stagehand_segment")
                if target is not None and target != s.index:
                    if not dag.has_edge(s.index, target):
                        dag.add_edge(s.index, target, values=[])
                    dag.edges[s.index, target]["values"].append(node.name)
    if not nx.is_directed_acyclic_graph(dag):
        raise RuntimeError("stagehand: segment graph has a cycle (partition bug)")
    return dag
