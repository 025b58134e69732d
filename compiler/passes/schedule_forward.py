"""Pass `schedule_forward`: prefetch / wait / evict nodes and their transfer tokens, per block variant graph:

    slot       = wait(fetch_tok, block_tok, nbytes, precision)   # replaces `weights`
    next_fetch = prefetch(next_tok, after=[slot])                # H2D of the next block overlaps this one
    ...        = linear(x, slot, ...)                            # every read depends on the wait
    free       = evict(block_tok, slot, readers=[...])           # after the last reader
    return (*outputs, next_fetch)                                # next block's graph waits on it
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.experts.stacks import expert_weights_from_slot
from torch_stagehand.runtime.ops import SCHEDULE_OPS

from torch_stagehand.compiler.context import VariantContext, compiler_pass
from torch_stagehand.compiler.graph_nodes import add_placeholder, descendants, example_value, find_placeholder
from torch_stagehand.compiler.passes.rewrite_linear import BLOCK_TOK, WEIGHTS

FETCH_TOK, NEXT_TOK = "stagehand_fetch_tok", "stagehand_next_tok"
TOKEN_INPUTS = (FETCH_TOK, BLOCK_TOK, NEXT_TOK, "stagehand_prev_tok")


def order_token_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """Put the token placeholders last, in TOKEN_INPUTS order (the unit's calling convention)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    last = placeholders[-1]
    for name in TOKEN_INPUTS:
        node = find_placeholder(gm, name)
        if node is not last:
            last.append(node)
        last = node
    return gm


def _reading_through_views(readers: list[fx.Node], output: fx.Node) -> list[fx.Node]:
    """The block's outputs computed from an expert stack read as a view of the slot (bf16): the GEMMs reading
    it come before them, and an evict ordered after the view alone could free the slot too early."""
    stacks = [r for r in readers if r.target is expert_weights_from_slot]
    if not stacks:
        return []
    seen = descendants(stacks, skip=output)
    return [a for a in output.all_input_nodes if a in seen and isinstance(example_value(a), torch.Tensor)]


@compiler_pass("schedule_forward")
def schedule_forward(gm: fx.GraphModule, ctx: VariantContext) -> fx.GraphModule:
    rt, graph, block, precision = ctx.runtime, gm.graph, ctx.block, ctx.precision
    weights = find_placeholder(gm, WEIGHTS)
    block_tok = find_placeholder(gm, BLOCK_TOK)
    fetch_tok = add_placeholder(gm, FETCH_TOK)
    next_tok = add_placeholder(gm, NEXT_TOK)
    nbytes, code = rt.block_nbytes(block, precision), precisions.get(precision).code
    with graph.inserting_after(next_tok):
        slot = graph.call_function(SCHEDULE_OPS["wait"], (fetch_tok, block_tok, nbytes, code, ctx.device))
    with graph.inserting_after(slot):
        next_fetch = graph.call_function(SCHEDULE_OPS["prefetch"], (next_tok, [slot]))
    weights.replace_all_uses_with(slot)
    graph.erase_node(weights)
    readers = [u for u in slot.users if u is not next_fetch]
    output = next(n for n in graph.nodes if n.op == "output")
    readers += _reading_through_views(readers, output)
    with graph.inserting_before(output):
        graph.call_function(SCHEDULE_OPS["evict"], (block_tok, slot, readers, code))
    results = output.args[0]
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    output.args = (results + (next_fetch,),)
    order_token_inputs(gm)
    graph.lint()
    gm.recompile()
    ctx.note(f"block {block}: wait + prefetch(next) + evict after {len(readers)} readers, {nbytes} B {precision}")
    return gm
