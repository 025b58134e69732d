"""The compiler passes, one per module, and the one ordered pass list per stage (the only place that knows it).

Every pass is named (`@compiler_pass(name)`), notes what it changed through `ctx.note` and is run by `PassLog.run`:

- `GRAPH_PASSES`, once per Dynamo graph, `(gm, CompileContext) -> gm` (split_segments returns the outer graph);
- `VARIANT_PASSES`, once per block variant on a copy of the block's segment, `(gm, VariantContext) -> gm`;
- `JOINT_PASSES`, inside AOTAutograd on the joint graph, `(fx.Graph, PassLog) -> fx.Graph` (FX cache key:
  `joint_passes_uuid()`).

Rules for pass authors: a pass never reaches into runtime state. A pass that evaluates, folds or proves something
about a graph value first asks `compiler.mutation.MutationIndex.writers(...)` about the value, what it is computed
from and what aliases them, and leaves it alone if anything writes there (or runs on the functionalized joint
graph). A pass notes what it changed, and what it declined to change and why.
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
    """The cache uuid Inductor sees for JOINT_PASSES (inner.JointPasses.uuid)."""
    from torch_stagehand.compiler.inner import JointPasses

    return JointPasses(JOINT_PASSES).uuid()


__all__ = ["GRAPH_PASSES", "VARIANT_PASSES", "JOINT_PASSES", "joint_passes_uuid", "pass_names", "inline_checkpoints",
           "causal_attention", "annotate_blocks", "assign_segments", "split_segments", "link_units", "rewrite_linear",
           "schedule_forward", "refetch_weights", "schedule_backward"]
