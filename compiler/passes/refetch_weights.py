"""Pass `refetch_weights`: no value computed from a block's weights alone crosses into the backward. Autograd's
formulas for the model's own expert-stack GEMMs read the stack in the backward, which the partitioner would save. On
the joint graph, for each forward `wait`, the values computed from the slot and constants alone (views, a
dequantization, a LoRA `baddbmm` of the stack) that the backward reads are recomputed there from the block's
`wait_bw` slot (deduped by `schedule_backward`). Nothing computed from an activation is touched."""

from __future__ import annotations

import torch
import torch.fx as fx

from torch_stagehand.runtime.ops import SCHEDULE_OPS

from torch_stagehand.compiler.context import PassLog, compiler_pass
from torch_stagehand.compiler.graph_nodes import descendants


def _reads_in_backward(node: fx.Node, backward: set[fx.Node]) -> bool:
    """A backward computation (the output node holds forward outputs too: not a reader to move)."""
    return node in backward and node.op != "output"


def _adapts(node: fx.Node, derived: set[fx.Node]) -> bool:
    """`baddbmm(stack, lhs, rhs)`: a LoRA delta added to an expert stack (runtime/experts/lora.py), recomputed in
    the backward from the refetched stack and the small factors (saved instead)."""
    return node.target is torch.ops.aten.baddbmm.default and node.args[0] in derived


def _weight_values(graph: fx.Graph, slot: fx.Node, backward: set[fx.Node]) -> list[fx.Node]:
    """The forward values computed from `slot` and constants alone (or adapted), in graph order, `slot` first."""
    derived = {slot}
    order = [slot]
    started = False
    for node in graph.nodes:
        if node is slot:
            started = True
            continue
        if not started or node.op != "call_function" or node in backward:
            continue
        inputs = node.all_input_nodes
        if inputs and all(i in derived for i in inputs) or _adapts(node, derived):
            derived.add(node)
            order.append(node)
    return order


@compiler_pass("refetch_weights")
def refetch_weights(graph: fx.Graph, ctx: PassLog) -> fx.Graph:
    wait, wait_bw = SCHEDULE_OPS["wait"], SCHEDULE_OPS["wait_bw"]
    waits = [n for n in graph.nodes if n.op == "call_function" and n.target is wait]
    if not waits:
        ctx.note("no forward wait: no block's weights in this graph")
        return graph
    # Everything the joint graph computes from its tangents (AOTAutograd names them `tangents_*`).
    backward = descendants([n for n in graph.nodes if n.op == "placeholder" and "tangents" in str(n.target)])
    position = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for slot in waits:
        values = _weight_values(graph, slot, backward)
        crossing = [v for v in values if any(_reads_in_backward(u, backward) for u in v.users)]
        if not crossing:
            continue
        readers = [u for v in crossing for u in v.users if _reads_in_backward(u, backward)]
        first = min(readers, key=position.__getitem__)
        anchor = next(i for i in first.all_input_nodes if i in backward)  # ordered after the gradient it needs
        _fetch_tok, block_tok, nbytes, code, device = slot.args
        needed = _ancestors_within(crossing, set(values))
        with graph.inserting_before(first):
            fresh = graph.call_function(wait_bw, (block_tok, anchor, nbytes, code, device))
            # The slot's value only: Inductor constrains a custom op's inputs to its node's `eager_input_vals`.
            fresh.meta.update({k: slot.meta[k] for k in ("val", "tensor_meta") if k in slot.meta})
            copies = {slot: fresh}
            for value in values[1:]:
                if value in needed:
                    copies[value] = graph.node_copy(value, lambda a: copies.get(a, a))
        for value in crossing:
            for user in [u for u in value.users if _reads_in_backward(u, backward)]:
                user.replace_input_with(value, copies[value])
        moved += len(crossing)
    graph.lint()
    ctx.note(f"{moved} weight values read in the backward from the block's wait_bw slot, not saved"
             if moved else "no weight value crosses into the backward")
    return graph


def _ancestors_within(nodes: list[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    found, frontier = set(nodes), list(nodes)
    while frontier:
        for i in frontier.pop().all_input_nodes:
            if i in within and i not in found:
                found.add(i)
                frontier.append(i)
    return found
