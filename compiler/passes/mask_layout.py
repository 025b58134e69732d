"""The layout ops of a mask's construction, for the proof (mask_proof.py): indexing, views, broadcasting. Each
handler returns the node's value in its own axes: a substitution of the source's axes, never a change of values.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch.fx as fx

from torch_stagehand.compiler.graph_nodes import example_value, node_arg
from torch_stagehand.compiler.passes.mask_algebra import Affine, Subst, Unknown, Value, _is_one, size_key, substitute


class MaskInterpreter(Protocol):
    """What a layout handler reads of the interpreter (mask_proof.py): the values known so far, per node."""

    known: dict[fx.Node, Any]  # node -> its value and fake tensor

    def ndim(self, node: fx.Node) -> int: ...

    def operand(self, x, out_ndim: int) -> Value: ...


def _identity(it: MaskInterpreter, node: fx.Node) -> Value:
    """Dtype and device changes (_normalise adapts the kind) and expands (new leading axes; size-1 axes carry no
    coefficient): the operand broadcast to the node's axes."""
    return it.operand(node.args[0], it.ndim(node))


def _axis_map(it: MaskInterpreter, node: fx.Node, image: Callable[[int], int]) -> Value:
    source = node.args[0]
    x = it.known[source].value
    return substitute(x, {a: (0, {image(a): 1}) for a in range(it.ndim(source))})


def _unsqueeze(it: MaskInterpreter, node: fx.Node) -> Value:
    d = node_arg(node, 1, "dim") % it.ndim(node)
    return _axis_map(it, node, lambda a: a if a < d else a + 1)


def _permute(it: MaskInterpreter, node: fx.Node) -> Value:
    dims = node.args[1:] if len(node.args) > 2 or not isinstance(node_arg(node, 1, "dims"), (tuple, list)) \
        else node_arg(node, 1, "dims")
    n = it.ndim(node)
    order = [d % n for d in dims]
    return _axis_map(it, node, order.index)


def _transpose(it: MaskInterpreter, node: fx.Node) -> Value:
    n = it.ndim(node)
    a, b = node_arg(node, 1, "dim0") % n, node_arg(node, 2, "dim1") % n
    return _axis_map(it, node, lambda x: b if x == a else a if x == b else x)


def _reshape(it: MaskInterpreter, node: fx.Node) -> Value:
    """A view that only adds or removes size-1 axes: the other axes keep their order and sizes."""
    source = node.args[0]
    old = [(a, s) for a, s in enumerate(example_value(source).shape) if not _is_one(s)]
    new = [(a, s) for a, s in enumerate(example_value(node).shape) if not _is_one(s)]
    if [size_key(s) for _, s in old] != [size_key(s) for _, s in new]:
        raise Unknown("a reshape that merges or splits axes")
    image = {a: b for (a, _), (b, _) in zip(old, new)}
    return substitute(it.known[source].value, {a: (0, {image[a]: 1}) for a in image})


def _getitem(it: MaskInterpreter, node: fx.Node) -> Value:
    source, index = node.args
    src_fake = example_value(source)
    items = list(index) if isinstance(index, tuple) else [index]
    consuming = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (src_fake.dim() - consuming)
    items += [slice(None)] * (src_fake.dim() - sum(1 for i in items if i is not None))
    advanced = [k for k, i in enumerate(items) if isinstance(i, fx.Node)]
    if advanced and any(i is None for i in items):
        raise Unknown("advanced indexing mixed with None")
    adjacent = advanced == list(range(advanced[0], advanced[-1] + 1)) if advanced else True
    group = max((it.ndim(items[k]) for k in advanced), default=0)
    # output axes: basic items in order, the advanced group where its first index stands (or in front)
    subst: Subst = {}
    out_axis = group if advanced and not adjacent else 0
    src_axis = 0
    group_start = None
    for k, item in enumerate(items):
        if item is None:
            out_axis += 1
            continue
        if isinstance(item, fx.Node):
            if group_start is None:
                group_start = out_axis if adjacent else 0
                if adjacent:
                    out_axis += group
            idx = it.operand(item, group)
            if not isinstance(idx, Affine) or not idx.integral:
                raise Unknown("indexing with a non-affine or boolean index")
            subst[src_axis] = (idx.const, {a + group_start: c for a, c in idx.coefs})
        elif isinstance(item, slice):
            start, step = item.start or 0, item.step or 1
            if not (isinstance(start, int) and isinstance(step, int)) or start < 0 or step < 1:
                raise Unknown("a slice with a negative or symbolic start or step")
            subst[src_axis] = (start, {out_axis: step})
            out_axis += 1
        elif isinstance(item, int):
            if item < 0:
                raise Unknown("a negative integer index")
            subst[src_axis] = (item, {})
        else:
            raise Unknown(f"index {item!r}")
        src_axis += 1
    if out_axis != it.ndim(node):
        raise Unknown("indexing whose result axes could not be placed")
    return substitute(it.known[source].value, subst)


LAYOUT_HANDLERS: dict[str, Callable] = {
    "getitem": _getitem, "unsqueeze": _unsqueeze, "permute": _permute, "transpose": _transpose,
    "reshape": _reshape, "expand": _identity, "identity": _identity,
}
