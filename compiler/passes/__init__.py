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
  schedule_backward. Inductor's FX cache keys on `joint_passes_uuid()`, a
  hash of the source of these passes' modules (source_hash.py).

The backend driver (backend.py) runs GRAPH_PASSES and hands the other two
lists to the units through the context, so this package is the only place
that knows the order.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..source_hash import passes_uuid
from .annotate_blocks import annotate_blocks
from .assign_segments import assign_segments
from .causal_attention import causal_attention
from .inline_checkpoints import inline_checkpoints
from .link_units import link_units
from .rewrite_linear import rewrite_linear
from .schedule_backward import schedule_backward
from .schedule_forward import schedule_forward
from .split_segments import split_segments

GRAPH_PASSES = (inline_checkpoints, causal_attention, annotate_blocks, assign_segments, split_segments, link_units)
VARIANT_PASSES = (rewrite_linear, schedule_forward)
JOINT_PASSES = (schedule_backward,)


def pass_names(passes: Sequence[Callable]) -> list[str]:
    return [p.name for p in passes]


def joint_passes_uuid() -> str:
    """The cache uuid Inductor sees for JOINT_PASSES (changes whenever their modules' source does)."""
    return passes_uuid(JOINT_PASSES)


__all__ = [
    "GRAPH_PASSES", "VARIANT_PASSES", "JOINT_PASSES", "joint_passes_uuid", "pass_names",
    "inline_checkpoints", "causal_attention", "annotate_blocks", "assign_segments", "split_segments", "link_units",
    "rewrite_linear", "schedule_forward", "schedule_backward",
]
