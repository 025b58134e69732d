"""The compiler passes, one per module, and the one ordered pass list per stage.

Every pass is named (`@compiler_pass(name)`), notes what it changed through
`ctx.note`, and is run by `PassLog.run(passes, target)`, which records the
passes that ran in order (`explain()` lists them). Three stages:

- `GRAPH_PASSES`, once per Dynamo graph, `(gm, CompileContext) -> gm`:
  inline_checkpoints (a model's own checkpointed blocks become block
  recompute) -> causal_attention (a constant causal mask becomes
  is_causal) -> annotate_blocks -> assign_segments (records the segments and their DAG on
  the context) -> split_segments (returns the outer graph) -> link_units.
- `VARIANT_PASSES`, once per block unit and precision, on a copy of the
  block's segment, `(gm, VariantContext) -> gm`: rewrite_linear -> schedule_forward.
- `JOINT_PASSES`, inside AOTAutograd on the joint forward+backward graph,
  `(fx.Graph, PassLog) -> fx.Graph` (Inductor hands a joint pass a Graph):
  refetch_weights (the backward reads weights from its own wait_bw, never
  a saved copy) -> schedule_backward. Inductor's FX cache keys on `joint_passes_uuid()`, a
  hash of the source of these passes' modules (source_hash.py).

The backend driver (backend.py) runs GRAPH_PASSES and hands the other two
lists to the units through the context, so this package is the only place
that knows the order.

Rules for pass authors:

- A pass never reaches into runtime state; it reads its context and the graph.
- A pass that evaluates, folds or proves something about a graph value
  respects mutation. Dynamo's graph is not functional: a value written in
  place (an in-place op, `setitem`, `out=`, a write into a view's base) after
  its node ran is not the value its construction shows, and no data edge
  leads from the write to the value's later readers. Before using a value's
  construction, ask `compiler.mutation.MutationIndex.writers(...)` about the
  value, everything it is computed from, and (through the fake storages)
  everything aliasing them; if anything writes there, leave the value alone
  (causal_attention, inner._bake_scalar_reads), or run on the functionalized
  graph inside AOTAutograd, where every write is explicit (JOINT_PASSES).
- A pass records what it changed, and what it declined to change with the
  reason, through `ctx.note` (`explain()` and `stagehand inspect` print it).
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch_stagehand.compiler.passes.annotate_blocks import annotate_blocks
from torch_stagehand.compiler.passes.assign_segments import assign_segments
from torch_stagehand.compiler.passes.causal_attention import causal_attention
from torch_stagehand.compiler.passes.inline_checkpoints import inline_checkpoints
from torch_stagehand.compiler.passes.link_units import link_units
from torch_stagehand.compiler.passes.refetch_weights import refetch_weights
from torch_stagehand.compiler.passes.rewrite_linear import rewrite_linear
from torch_stagehand.compiler.passes.schedule_backward import schedule_backward
from torch_stagehand.compiler.passes.schedule_forward import schedule_forward
from torch_stagehand.compiler.passes.split_segments import split_segments

GRAPH_PASSES = (inline_checkpoints, causal_attention, annotate_blocks, assign_segments, split_segments, link_units)
VARIANT_PASSES = (rewrite_linear, schedule_forward)
JOINT_PASSES = (refetch_weights, schedule_backward)


def pass_names(passes: Sequence[Callable]) -> list[str]:
    return [p.name for p in passes]


def joint_passes_uuid() -> str:
    """The cache uuid Inductor sees for JOINT_PASSES (changes whenever their modules' source, or the ops'
    registrations they trace through, do: inner.JointPasses.uuid)."""
    from torch_stagehand.compiler.inner import JointPasses

    return JointPasses(JOINT_PASSES).uuid()


__all__ = [
    "GRAPH_PASSES", "VARIANT_PASSES", "JOINT_PASSES", "joint_passes_uuid", "pass_names",
    "inline_checkpoints", "causal_attention", "annotate_blocks", "assign_segments", "split_segments", "link_units",
    "rewrite_linear", "schedule_forward", "refetch_weights", "schedule_backward",
]
