"""Pass `split_segments`: the outer graph calling one submodule `submod_<index>` per recorded segment, in order
(`torch.fx.passes.split_module`); it replaces the input graph."""

from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from torch_stagehand.compiler.context import CompileContext, compiler_pass


@compiler_pass("split_segments")
def split_segments(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    def segment_of(node: fx.Node) -> int:
        if "stagehand_segment" in node.meta:
            return node.meta["stagehand_segment"]
        users = [u.meta.get("stagehand_segment") for u in node.users]
        return min(u for u in users if u is not None)  # a get_attr goes with its first user

    outer = split_module(gm, None, segment_of, keep_original_order=True)
    ctx.note(f"{len(ctx.segments)} submodules under the outer graph")
    return outer
