"""The `stagehand` torch.compile backend (`torch.compile(model, backend="stagehand", options={...})`). On each Dynamo
graph it finds the offloaded runtime the graph streams from and runs `passes.GRAPH_PASSES`: the result is an outer
graph, run as plain Python, that calls one compiled unit per segment (units.py)."""

from __future__ import annotations

import itertools
import logging
import warnings
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx

from torch_stagehand.runtime import registry

from torch_stagehand.compiler.context import BackendOptions, CompileContext, PassLog, PassRecord
from torch_stagehand.compiler.graph_nodes import streams, token_owners
from torch_stagehand.compiler.inner import compile_unit, warm_compile_workers
from torch_stagehand.compiler.interface import StreamingRuntime
from torch_stagehand.compiler.passes import GRAPH_PASSES, JOINT_PASSES, VARIANT_PASSES
from torch_stagehand.compiler.passes.assign_segments import Segment
from torch_stagehand.compiler.variants import variant_cache

log = logging.getLogger("torch_stagehand.compiler")
_graph_ids = itertools.count()
_warned_not_offloaded = False


class NotOffloadedWarning(UserWarning):
    """The backend compiled a model that was never offloaded: nothing streams (it works, plainly)."""


@dataclass
class GraphRecord:
    """What the backend did to one Dynamo graph (explain reads these)."""

    graph_id: int
    segments: list[Segment]
    dag: nx.DiGraph
    outer: fx.GraphModule
    passes: list[PassRecord] = field(default_factory=list)  # the graph-level passes that ran, in order
    input_shapes: list[str] = field(default_factory=list)  # each graph input's shape and dtype (the cost model's key)

    @property
    def changes(self) -> list[str]:
        return [f"[{r.name}] {m}" for r in self.passes for m in r.notes]


def _runtime_of(gm: fx.GraphModule, tokens: dict[str, tuple[StreamingRuntime, int]]) -> StreamingRuntime | None:
    """The offloaded runtime whose block tokens the graph takes (None: nothing streams here)."""
    runtimes = {id(rt): rt for rt, _block in tokens.values()}
    if len(runtimes) > 1:
        raise RuntimeError("stagehand: one compiled graph streams layers of two different offloaded models")
    if not runtimes and streams(gm) is not None:
        raise RuntimeError("stagehand: the graph calls streamed linears but takes no block token of a live "
                           "offloaded model (was the model restored or its Runtime closed?)")
    return next(iter(runtimes.values()), None)


def stagehand_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None):
    opts = BackendOptions.from_dict(options)
    tokens = token_owners(gm, example_inputs)
    rt = _runtime_of(gm, tokens)
    if rt is None:  # nothing streams in this graph (e.g. a graph break left only glue)
        _warn_if_nothing_offloaded()
        log.info("stagehand: graph has no streamed layers; compiling it with %s alone", opts.inner)
        return compile_unit(gm, list(example_inputs), opts.inner, lambda *_: None, JOINT_PASSES, PassLog())
    if opts.inner == "inductor":
        warm_compile_workers(rt.device)  # offload() started them; a runtime made otherwise starts them here
    variants = variant_cache(rt)
    variants.use_ahead(opts.workers_ahead(rt.device))
    ctx = CompileContext(rt, opts, variants, VARIANT_PASSES, JOINT_PASSES, graph_id=next(_graph_ids),
                         tokens=tokens)
    outer = ctx.run(GRAPH_PASSES, gm)
    # Each input as `shape:dtype` (a symbolic size reads as its symbol), or its value.
    shapes = [f"{tuple(x.shape)}:{x.dtype}" if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs]
    rt.record_graph(GraphRecord(ctx.graph_id, ctx.segments, ctx.dag, outer, ctx.passes_ran, shapes))
    return outer


def _warn_if_nothing_offloaded() -> None:
    """Say once when no model is offloaded at all; glue graphs of an offloaded model are normal and stay quiet."""
    global _warned_not_offloaded
    if _warned_not_offloaded or registry.has_runtimes():
        return
    _warned_not_offloaded = True
    warnings.warn("stagehand: torch.compile(backend='stagehand') got a graph but no model is offloaded, so nothing "
                  "streams and the graph is compiled plainly; call torch_stagehand.offload(model) before compiling",
                  NotOffloadedWarning, stacklevel=2)
