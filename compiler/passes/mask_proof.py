"""Prove from its construction that an attention mask is the causal triangle, for any sequence length. This
interprets the construction over mask_algebra's closed forms of the element's indices (aranges, comparisons, tril /
triu, fills, broadcasting, indexing), so the proof holds for every size. Axes of static size 1 carry no coefficient,
which makes broadcasting a shift of axis numbers. An op outside the algebra makes the verdict `unknown`; another
pattern, `other`. The caller must first rule out in-place writes (`compiler/mutation.py`)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from torch_stagehand.compiler.graph_nodes import example_value, node_arg
from torch_stagehand.compiler.passes.mask_algebra import (
    FALSE, TRUE, Affine, Conj, Select, Unknown, Value, _and, _atom, _coefs, _constant, _is_one, _not, allowed_positions,
    const_value, is_causal_triangle, shifted, size_key, substitute)
from torch_stagehand.compiler.passes.mask_layout import LAYOUT_HANDLERS

# ---- the interpreter --------------------------------------------------------------------------------

@dataclass
class _Node:
    """What the interpreter knows of a node: its value (None for a non-tensor) and its fake tensor."""
    value: Value | None
    fake: Any


def _scalar(x) -> float:
    if isinstance(x, (int, float)):  # bool included
        return float(x)
    raise Unknown(f"a non-constant scalar {x!r}")


class MaskInterpreter:
    """Values of the mask's construction nodes, in graph order (`run`), each normalised to its fake shape."""

    def __init__(self):
        self.known: dict[fx.Node, _Node] = {}

    def run(self, nodes: list[fx.Node]) -> Value:
        for node in nodes:
            fake = example_value(node)
            if not isinstance(fake, torch.Tensor):
                self.known[node] = _Node(None, fake)  # a size or a Python number
                continue
            handler = _HANDLERS.get(_op_name(node))
            if handler is None:
                raise Unknown(f"{node.name}: {_op_name(node) or node.target} is not modelled")
            self.known[node] = _Node(_normalise(handler(self, node), fake), fake)
        return self.known[nodes[-1]].value

    # operands -----------------------------------------------------------------------------------
    def ndim(self, node: fx.Node) -> int:
        return example_value(node).dim()

    def operand(self, x, out_ndim: int) -> Value:
        """An argument as a value in the axes of a result of `out_ndim` axes (broadcast from the right)."""
        if isinstance(x, fx.Node):
            known = self.known.get(x)
            if known is None or known.value is None:
                if known is not None and isinstance(known.fake, (int, float, bool)):
                    return const_value(float(known.fake), isinstance(known.fake, (int, bool)))
                raise Unknown(f"{x.name} is not a tensor of the mask's construction")
            return shifted(known.value, out_ndim - known.fake.dim())
        return const_value(_scalar(x), isinstance(x, (int, bool)))


def _normalise(x: Value, fake: torch.Tensor) -> Value:
    """Drop coefficients on axes of static size 1, and make a bool tensor a Conj and any other tensor not one."""
    ones = [a for a, s in enumerate(fake.shape) if _is_one(s)]
    if ones:
        keep = {a: (0, {a: 1}) for a in range(fake.dim()) if a not in ones}
        x = substitute(x, {**keep, **{a: (0, {}) for a in ones}})
    if fake.dtype == torch.bool and not isinstance(x, Conj):
        c = _constant(x)
        if c is None:
            if isinstance(x, Select) and x.off == 0:
                return x.cond
            raise Unknown("a numeric tensor made boolean")
        return TRUE if c != 0 else FALSE
    if fake.dtype != torch.bool and isinstance(x, Conj):
        c = _constant(x)
        return const_value(c, True) if c is not None else Select(x, 1.0, 0.0)
    return x


def _op_name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function" and getattr(node.target, "__module__", None) in ("torch", "_operator"):
        name = node.target.__name__
    else:
        return None
    return _ALIASES.get(name, name)


# sources ------------------------------------------------------------------------------------------

def _arange(it: MaskInterpreter, node: fx.Node) -> Value:
    """arange(end) or arange(start, end, step): element i is start + step * i (the end sets the size only)."""
    args = list(node.args)
    start = args[0] if len(args) > 1 else node.kwargs.get("start", 0)
    step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
    if not all(isinstance(v, int) for v in (start, step)):
        raise Unknown("arange with a non-integer start or step")
    return Affine(float(start), _coefs({0: step}), True)


def _filled(fill: Callable[[fx.Node], Any]) -> Callable:
    def handler(it: MaskInterpreter, node: fx.Node) -> Value:
        value = fill(node)
        return const_value(_scalar(value), isinstance(value, (int, bool)))
    return handler


# arithmetic and comparisons -----------------------------------------------------------------------

def _binary(it: MaskInterpreter, node: fx.Node) -> tuple[Value, Value]:
    n = it.ndim(node)
    return it.operand(node_arg(node, 0, "input"), n), it.operand(node_arg(node, 1, "other"), n)


def _add(sign: int, reverse: bool = False) -> Callable:
    def handler(it: MaskInterpreter, node: fx.Node) -> Value:
        x, y = _binary(it, node)
        if reverse:
            x, y = y, x
        alpha = node.kwargs.get("alpha", 1)
        if isinstance(x, Select) and _constant(y) is not None:
            return Select(x.cond, x.on + sign * alpha * _constant(y), x.off + sign * alpha * _constant(y))
        if not (isinstance(x, Affine) and isinstance(y, Affine)):
            raise Unknown("a sum of a mask and a non-constant")
        y = y.scaled(sign * alpha)
        coefs = dict(x.coefs)
        for a, c in y.coefs:
            coefs[a] = coefs.get(a, 0) + c
        return Affine(x.const + y.const, _coefs(coefs), x.integral and y.integral)
    return handler


def _mul(it: MaskInterpreter, node: fx.Node) -> Value:
    x, y = _binary(it, node)
    if _constant(x) is not None:
        x, y = y, x
    k = _constant(y)
    if k is None:
        raise Unknown("a product of two non-constant tensors")
    if isinstance(x, Select):
        return Select(x.cond, x.on * k, x.off * k)
    if isinstance(x, Conj):
        return Select(x, k, 0.0)  # a bool mask times k (bool again if the result is: _normalise)
    return x.scaled(k)


def _neg(it: MaskInterpreter, node: fx.Node) -> Value:
    x = it.operand(node.args[0], it.ndim(node))
    if isinstance(x, Affine):
        return x.scaled(-1)
    raise Unknown("negation of a mask")


_COMPARE = {"le": operator.le, "lt": operator.lt, "ge": operator.ge, "gt": operator.gt, "eq": operator.eq,
            "ne": operator.ne}


def _compare(name: str) -> Callable:
    def handler(it: MaskInterpreter, node: fx.Node) -> Value:
        x, y = _binary(it, node)
        if isinstance(x, Select) or isinstance(y, Select):
            return _compare_select(name, x, y)
        if not (isinstance(x, Affine) and isinstance(y, Affine)):
            raise Unknown(f"{name} of a boolean tensor")
        if not (x.integral and y.integral):
            raise Unknown(f"{name} of non-integer values")
        d = dict(x.coefs)
        for a, c in y.coefs:
            d[a] = d.get(a, 0) - c
        const = x.const - y.const  # the comparison is  const + sum(d * i)  OP  0
        neg = {a: -c for a, c in d.items()}
        if name in ("le", "lt"):  # integers: e < 0 <=> e + 1 <= 0
            return _atom(const + (name == "lt"), d)
        if name in ("ge", "gt"):
            return _atom((name == "gt") - const, neg)
        if name == "eq":
            return _and(_atom(const, d), _atom(-const, neg))
        if any(d.values()):
            raise Unknown("!= of non-constant values (an OR)")
        return TRUE if const != 0 else FALSE
    return handler


def _compare_select(name: str, x: Value, y: Value) -> Value:
    """`additive_mask == 0` and the like: the comparison holds on `on`, on `off`, on both or on neither."""
    sel, other, flip = (x, y, False) if isinstance(x, Select) else (y, x, True)
    c = _constant(other)
    if c is None:
        raise Unknown("a comparison of an additive mask with a non-constant")
    op = _COMPARE[name]
    on, off = (op(c, sel.on), op(c, sel.off)) if flip else (op(sel.on, c), op(sel.off, c))
    if on and off:
        return TRUE
    if not on and not off:
        return FALSE
    return sel.cond if on else _not(sel.cond)


def _logical(kind: str) -> Callable:
    def handler(it: MaskInterpreter, node: fx.Node) -> Value:
        x, y = (_as_conj(v) for v in _binary(it, node))
        if kind == "and":
            return _and(x, y)
        # or: decided only where one side is a constant (an OR of conditions is outside the algebra)
        for a, b in ((x, y), (y, x)):
            if a.false:
                return b
            if not a.atoms:
                return TRUE
        raise Unknown("an OR of two conditions")
    return handler


def _as_conj(x: Value) -> Conj:
    if isinstance(x, Conj):
        return x
    c = _constant(x)
    if c is None:
        raise Unknown("a logical op on a numeric tensor")
    return TRUE if c else FALSE


# masks from conditions ----------------------------------------------------------------------------

def _triangle(lower: bool) -> Callable:
    def handler(it: MaskInterpreter, node: fx.Node) -> Value:
        n = it.ndim(node)
        x = it.operand(node.args[0], n)
        diagonal = node_arg(node, 1, "diagonal", 0)
        if not isinstance(diagonal, int):
            raise Unknown("tril / triu with a non-constant diagonal")
        row, col = n - 2, n - 1
        # tril keeps col - row <= diagonal; triu keeps col - row >= diagonal
        kept = _atom(-diagonal, {col: 1, row: -1}) if lower else _atom(diagonal, {row: 1, col: -1})
        if isinstance(x, Conj):
            return _and(x, kept)
        c = _constant(x)
        if c is None:
            raise Unknown("tril / triu of a non-constant tensor")
        return Select(kept, c, 0.0)
    return handler


def _where(it: MaskInterpreter, node: fx.Node) -> Value:
    n = it.ndim(node)
    cond = _as_conj(it.operand(node.args[0], n))
    on, off = (_constant(it.operand(a, n)) for a in node.args[1:3])
    if on is None or off is None:
        raise Unknown("where with non-constant branches")
    return Select(cond, on, off)


def _masked_fill(it: MaskInterpreter, node: fx.Node) -> Value:
    n = it.ndim(node)
    x = it.operand(node.args[0], n)
    where = _as_conj(it.operand(node_arg(node, 1, "mask"), n))
    value = _constant(it.operand(node_arg(node, 2, "value"), n))
    if value is None:
        raise Unknown("masked_fill with a tensor value")
    if isinstance(x, Conj):  # bool: filled False removes `where`, filled True is an OR
        if value == 0:
            return _and(x, _not(where))
        raise Unknown("a boolean mask filled with True (an OR)")
    c = _constant(x)
    if c is None:
        raise Unknown("masked_fill of a non-constant tensor")
    return Select(where, value, c)


def _cumsum(it: MaskInterpreter, node: fx.Node) -> Value:
    n = it.ndim(node)
    c = _constant(it.operand(node.args[0], n))
    dim = node_arg(node, 1, "dim")
    if c is None or not isinstance(dim, int):
        raise Unknown("cumsum of a non-constant tensor")
    return Affine(c, _coefs({dim % n: c}), float(c).is_integer())  # c * (i + 1)


def _diff(it: MaskInterpreter, node: fx.Node) -> Value:
    """diff of `a * i + rest` along its axis is `a`; with `prepend`, its first element must be `a` too."""
    n = it.ndim(node)
    x = it.operand(node.args[0], n)
    if node_arg(node, 1, "n", 1) != 1 or node.kwargs.get("append") is not None or not isinstance(x, Affine):
        raise Unknown("diff other than one step of an affine tensor")
    dim = node_arg(node, 2, "dim", -1) % n
    step = dict(x.coefs).get(dim, 0)
    prepend = node_arg(node, 3, "prepend")
    if prepend is not None:
        p = it.operand(prepend, n)
        if not isinstance(p, Affine):
            raise Unknown("diff with a non-affine prepend")
        first = {a: c for a, c in x.coefs if a != dim}
        for a, c in p.coefs:
            first[a] = first.get(a, 0) - c
        if any(first.values()) or x.const - p.const != step:
            raise Unknown("diff whose first element differs from its step")
    return Affine(float(step), (), x.integral)


# the handlers by op name (layout: mask_layout.py) ------------------------------------------------

# The handler's name for a torch or operator function's or a Tensor method's name, where they differ.
_ALIASES = {
    "__add__": "add", "__radd__": "add", "__sub__": "sub", "__rsub__": "rsub", "__mul__": "mul", "__rmul__": "mul",
    "__neg__": "neg", "__le__": "le", "__lt__": "lt", "__ge__": "ge", "__gt__": "gt", "__eq__": "eq", "__ne__": "ne",
    "and_": "and", "__and__": "and", "__rand__": "and", "logical_and": "and", "bitwise_and": "and",
    "or_": "or", "__or__": "or", "__ror__": "or", "logical_or": "or", "bitwise_or": "or",
    "__invert__": "invert", "logical_not": "invert", "bitwise_not": "invert", "__getitem__": "getitem",
    "new_ones": "ones", "new_zeros": "zeros", "view": "reshape", "expand_as": "expand", "broadcast_to": "expand",
    **{m: "identity" for m in ("to", "type", "type_as", "bool", "int", "long", "float", "half", "bfloat16",
                               "double", "contiguous", "clone", "detach", "cuda", "cpu")},
}
_HANDLERS: dict[str, Callable[[MaskInterpreter, fx.Node], Value]] = {
    "arange": _arange, "ones": _filled(lambda n: 1), "ones_like": _filled(lambda n: 1), "zeros": _filled(lambda n: 0),
    "zeros_like": _filled(lambda n: 0), "new_full": _filled(lambda n: node_arg(n, 2, "fill_value")),
    **{name: _filled(lambda n: node_arg(n, 1, "fill_value")) for name in ("full", "full_like")},
    "add": _add(1), "sub": _add(-1), "rsub": _add(-1, reverse=True), "mul": _mul, "neg": _neg,
    **{name: _compare(name) for name in _COMPARE},
    "and": _logical("and"), "or": _logical("or"),
    "invert": lambda it, node: _not(_as_conj(it.operand(node.args[0], it.ndim(node)))),
    "tril": _triangle(lower=True), "triu": _triangle(lower=False), "where": _where, "masked_fill": _masked_fill,
    "cumsum": _cumsum, "diff": _diff, **LAYOUT_HANDLERS,
}


# the verdict ---------------------------------------------------------------------------------------

def prove_causal(nodes: list[fx.Node]) -> tuple[str, str]:
    """('causal' | 'other' | 'unknown', why) for the mask that `nodes` (its construction, in order) build."""
    mask = nodes[-1]
    fake = example_value(mask)
    try:
        value = MaskInterpreter().run(nodes)
    except Unknown as e:
        return "unknown", str(e)
    allowed = allowed_positions(value, fake.dtype)
    if allowed is None:
        return "other", "an additive bias, not a mask of 0 and -inf"
    if is_causal_triangle(allowed, fake.dim()):
        return "causal", "the causal triangle by construction"
    return "other", "not the causal triangle"


__all__ = ["Affine", "Conj", "Select", "Unknown", "MaskInterpreter", "prove_causal", "size_key",
           "allowed_positions", "is_causal_triangle"]
