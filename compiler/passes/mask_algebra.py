"""The values a causal-mask proof computes with (mask_proof.py): closed forms of a tensor's elements.

- `Affine`: an integer tensor whose element at index (i0, i1, ...) is `const + sum(coef[a] * i_a)`.
- `Conj`: a boolean tensor that is the AND of atoms `const + sum(coef[a] * i_a) <= 0`.
- `Select`: a float tensor `on` where a `Conj` holds, `off` elsewhere (an additive mask).

A value lives in the axes of the node that made it; `substitute` re-expresses it in another node's axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

Coefs = tuple[tuple[int, int], ...]  # ((axis, coef), ...), sorted, no zero coef


class Unknown(Exception):
    """The construction uses something the algebra does not model (the proof cannot decide)."""


def _coefs(d: dict[int, int]) -> Coefs:
    return tuple(sorted((a, c) for a, c in d.items() if c))


@dataclass(frozen=True)
class Affine:
    const: float
    coefs: Coefs = ()
    integral: bool = True  # every element an integer (comparisons may then be tightened: x < y <=> x + 1 <= y)

    def scaled(self, k: float) -> "Affine":
        integral = self.integral and float(k).is_integer()
        return Affine(self.const * k, _coefs({a: c * k for a, c in self.coefs}), integral)


@dataclass(frozen=True)
class Conj:
    atoms: frozenset = frozenset()  # of (const, coefs): const + sum(coef * index) <= 0
    false: bool = False


@dataclass(frozen=True)
class Select:
    cond: Conj
    on: float
    off: float


TRUE, FALSE = Conj(), Conj(false=True)
Value = Affine | Conj | Select


def _atom(const: float, coefs: dict[int, int]) -> Conj:
    """`const + sum(coef * i) <= 0` as a Conj: constant atoms decide at once; others reduced by their gcd."""
    coefs = {a: c for a, c in coefs.items() if c}
    if not coefs:
        return TRUE if const <= 0 else FALSE
    if any(not float(c).is_integer() for c in coefs.values()) or not float(const).is_integer():
        raise Unknown("a comparison with non-integer coefficients")
    g = math.gcd(*(int(c) for c in coefs.values()))
    # integers: sum(a x) + c <= 0  <=>  sum(a/g x) <= floor(-c/g)  <=>  sum(a/g x) + ceil(c/g) <= 0
    return Conj(frozenset({(math.ceil(const / g), _coefs({a: int(c) // g for a, c in coefs.items()}))}))


def _and(x: Conj, y: Conj) -> Conj:
    return FALSE if x.false or y.false else Conj(x.atoms | y.atoms)


def _not(x: Conj) -> Conj:
    if x.false:
        return TRUE
    if not x.atoms:
        return FALSE
    if len(x.atoms) > 1:
        raise Unknown("the negation of several conditions (an OR)")
    (const, coefs), = x.atoms
    return _atom(1 - const, {a: -c for a, c in coefs})  # not(e <= 0) <=> e >= 1 <=> -e + 1 <= 0


def _constant(x: Value) -> float | None:
    if isinstance(x, Affine) and not x.coefs:
        return x.const
    if isinstance(x, Conj) and (x.false or not x.atoms):
        return 0.0 if x.false else 1.0
    if isinstance(x, Select) and x.on == x.off:
        return x.on
    return None


# ---- substitution: re-express a value in another node's axes --------------------------------------

Subst = dict[int, tuple[float, dict[int, int]]]  # old axis -> (offset, {new axis: coef})


def _subst_linear(const: float, coefs: Coefs, subst: Subst) -> tuple[float, dict[int, int]]:
    new_const, new = const, {}
    for axis, coef in coefs:
        if axis not in subst:
            raise Unknown(f"axis {axis} has no image")
        offset, image = subst[axis]
        new_const += coef * offset
        for b, m in image.items():
            new[b] = new.get(b, 0) + coef * m
    return new_const, new


def substitute(x: Value, subst: Subst) -> Value:
    if isinstance(x, Affine):
        const, coefs = _subst_linear(x.const, x.coefs, subst)
        return Affine(const, _coefs(coefs), x.integral)
    if isinstance(x, Conj):
        out = TRUE if not x.false else FALSE
        for const, coefs in x.atoms:
            out = _and(out, _atom(*_subst_linear(const, coefs, subst)))
        return out
    return Select(substitute(x.cond, subst), x.on, x.off)


def shifted(x: Value, by: int) -> Value:
    """The value seen from a node with `by` more leading axes (broadcasting)."""
    conj = x.cond if isinstance(x, Select) else x
    axes = {a for a, _ in x.coefs} if isinstance(x, Affine) else {a for _, cs in conj.atoms for a, _ in cs}
    return substitute(x, {a: (0, {a + by: 1}) for a in axes}) if by else x


# ---- sizes ------------------------------------------------------------------------------------------

def size_key(size) -> Any:
    """A size compared structurally: an int, or a SymInt's sympy expression (no guard is created)."""
    return size.node.expr if isinstance(size, torch.SymInt) else int(size)


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def const_value(c: float, integral: bool) -> Affine:
    return Affine(c, (), integral and float(c).is_integer())


def allowed_positions(mask: Value, dtype: torch.dtype) -> Conj | None:
    """Where attention may look: the mask itself (bool) or where an additive mask adds 0 and blocks elsewhere."""
    if isinstance(mask, Conj):
        return mask
    if isinstance(mask, Select) and dtype.is_floating_point:
        lowest = torch.finfo(dtype).min

        def blocked(v: float) -> bool:
            return v == float("-inf") or v <= lowest
        if mask.on == 0 and blocked(mask.off):
            return mask.cond
        if blocked(mask.on) and mask.off == 0:
            return _not(mask.cond)
    return None


def is_causal_triangle(allowed: Conj, ndim: int) -> bool:
    """Exactly `key index <= query index` over the last two axes; atoms true at every index >= 0 dropped."""
    if allowed.false:
        return False
    real = {(c, cs) for c, cs in allowed.atoms if not (c <= 0 and all(k <= 0 for _, k in cs))}
    return real == {(0, ((ndim - 2, -1), (ndim - 1, 1)))}
