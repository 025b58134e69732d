"""Pass `schedule_backward`: the backward half of the schedule, on the joint graph before it is partitioned. Each
`linear`'s backward asks for its block with `wait_bw` and prefetches the previous block; this keeps one `wait_bw` and
one `prefetch` per block and closes the block's backward with an `evict` after its last reader."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from torch_stagehand.runtime.ops import SCHEDULE_OPS

from torch_stagehand.compiler.context import PassLog, compiler_pass


@compiler_pass("schedule_backward")
def schedule_backward(graph: fx.Graph, ctx: PassLog) -> fx.Graph:
    wait_bw, prefetch, evict = SCHEDULE_OPS["wait_bw"], SCHEDULE_OPS["prefetch"], SCHEDULE_OPS["evict"]
    kept: dict[tuple, fx.Node] = {}
    waits = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is wait_bw:
            waits += 1
            key = (node.args[0], node.args[2], node.args[3])  # block token, nbytes, precision
            if key in kept:
                node.replace_all_uses_with(kept[key])
                graph.erase_node(node)
            else:
                kept[key] = node
    if not kept:
        ctx.note("no wait_bw: nothing streams backward in this graph")
        return graph
    slots = set(kept.values())
    seen_prefetch: set[fx.Node] = set()
    dropped_prefetches = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is prefetch and any(a in slots for a in node.args[1]):
            if node.args[0] in seen_prefetch and not node.users:
                graph.erase_node(node)
                dropped_prefetches += 1
            else:
                seen_prefetch.add(node.args[0])
    position = {n: i for i, n in enumerate(graph.nodes)}
    for (block_tok, _nbytes, code), slot in kept.items():
        readers = _readers(slot, prefetch)
        last = max(readers, key=position.__getitem__)
        with graph.inserting_after(last):
            node = graph.call_function(evict, (block_tok, slot, readers, code))
        mode = getattr(slot.meta.get("val"), "fake_mode", None)
        if isinstance(mode, FakeTensorMode):  # the evict's token, faked as the slot is
            with mode:
                node.meta["val"] = torch.empty((), dtype=torch.int64)
    graph.lint()
    ctx.note(f"{waits} wait_bw -> {len(kept)} (one per block), {dropped_prefetches} duplicate prefetches "
             f"dropped, {len(kept)} evicts after the last reader")
    return graph


def _readers(slot: fx.Node, prefetch) -> list[fx.Node]:
    """The nodes that read the slot's bytes: its users, and past a view (fp8's traced linear slices the slot)
    or an op of several results, their users: an evict after a view alone could free the slot too early."""
    readers, todo = [], [u for u in slot.users if u.target is not prefetch]
    while todo:
        node = todo.pop()
        if (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
                or isinstance(node.meta.get("val"), (tuple, list))):  # a view, or several results: their getitems
            todo.extend(node.users)
        elif node not in readers:
            readers.append(node)
    return readers
