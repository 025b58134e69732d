"""Pass `partition`: tag every node with its block and cut the graph into segments.

A segment is a maximal run of nodes (in graph order) that belong to one block,
or a run of "glue" that belongs to none (prologue, epilogue, code between
blocks). Streamed-linear nodes know their block from the layer id they carry;
every other node finds it through `nn_module_stack`. Nodes with no module
(getitem, size arithmetic) and glue that sits inside a block's run (the next
block-owned node is the same block) join the block's segment, so a block is
one unit unless the code really leaves it. A graph break inside a block gives
two partial segments of that block, each fetching and releasing it: correct,
and the second usually finds the weights still resident.

The segment DAG lives in networkx: edges carry the values that cross segment
boundaries, which `explain()` prints and the schedule reads for the order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import networkx as nx
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from torch_stagehand.runtime.ops import STREAMED_LINEAR_OPS

from .context import CompileContext

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


def is_streamed_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in STREAMED_LINEAR_OPS


def annotate_blocks(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Set node.meta['stagehand_block'] (int or None) and, on streamed linears, 'stagehand_layer'."""
    rt = ctx.runtime
    block_index = {fqn: i for i, fqn in enumerate(rt.blocks)}
    prefixes: set[str] = set()
    for node in gm.graph.nodes:
        if is_streamed_linear(node):
            rt_of_layer, index = _layer_of(node)
            if rt_of_layer is not rt:
                raise RuntimeError("stagehand: one compiled graph streams layers of two different offloaded models")
            spec = rt.layers[index]
            node.meta["stagehand_layer"] = index
            node.meta["stagehand_block"] = spec.block
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
    ctx.note("partition", f"tagged {tagged} nodes with their block (module-path prefixes {sorted(prefixes)})")
    return gm


def _layer_of(node: fx.Node):
    from torch_stagehand.runtime import registry

    return registry.layer(node.args[2] if len(node.args) > 2 else node.kwargs["layer"])


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


def assign_segments(gm: fx.GraphModule, ctx: CompileContext) -> list[Segment]:
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
    ctx.note(
        "partition",
        f"{len(segments)} segments: {len(counts)} block, {len(segments) - len(counts)} glue"
        + (f", {partial} block(s) split by glue or graph order" if partial else ""),
    )
    return segments


def segment_dag(gm: fx.GraphModule, segments: list[Segment]) -> nx.DiGraph:
    """Segments as a DAG; an edge u->v lists the values u produces that v reads."""
    dag = nx.DiGraph()
    for s in segments:
        dag.add_node(s.index, kind=s.kind, block=s.block, ops=len(s.nodes),
                     streamed=sum(is_streamed_linear(n) for n in s.nodes))
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


def split(gm: fx.GraphModule, segments: list[Segment]) -> fx.GraphModule:
    """One submodule per segment (`submod_<index>`), called in order by an outer graph."""

    def segment_of(node: fx.Node) -> int:
        if "stagehand_segment" in node.meta:
            return node.meta["stagehand_segment"]
        users = [u.meta.get("stagehand_segment") for u in node.users]
        return min(u for u in users if u is not None)  # a get_attr goes with its first user

    return split_module(gm, None, segment_of, keep_original_order=True)
