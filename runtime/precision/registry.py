"""The precisions stagehand can stream, by name (precision maps, the CLI, telemetry) and by code (op schemas and
layouts): a new precision is one `register(entry)`."""

from __future__ import annotations

import torch

from torch_stagehand.runtime.precision.base import Precision
from torch_stagehand.runtime.precision.by_role import ATTENTION, MLP, ByRole, by_role_name, by_roles_name
from torch_stagehand.runtime.precision.fp8 import Fp8PerRow
from torch_stagehand.runtime.precision.full import FullPrecision
from torch_stagehand.runtime.precision.int8 import Int8PerRow
from torch_stagehand.runtime.precision.layout import LayerLayout

_BY_NAME: dict[str, Precision] = {}
_BY_CODE: dict[int, Precision] = {}


def register(entry: Precision) -> Precision:
    """Add a precision; its name and code must be new."""
    if not isinstance(entry, Precision):
        raise TypeError(f"register: expected a Precision, got {type(entry).__name__}")
    if entry.name in _BY_NAME:
        raise ValueError(f"register: a precision named {entry.name!r} exists already")
    if entry.code in _BY_CODE:
        raise ValueError(f"register: code {entry.code} is taken by {_BY_CODE[entry.code].name!r}")
    _BY_NAME[entry.name] = _BY_CODE[entry.code] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a precision (tests); the full-precision master cannot go."""
    entry = get(name)
    if not entry.derived_from_master:
        raise ValueError(f"unregister: {name!r} is the full-precision master")
    del _BY_NAME[entry.name], _BY_CODE[entry.code]


def get(name: str) -> Precision:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown precision {name!r} (known: {', '.join(names())})") from None


def by_code(code: int) -> Precision:
    try:
        return _BY_CODE[code]
    except KeyError:
        raise KeyError(f"no precision has code {code} (known: {sorted(_BY_CODE)})") from None


def names() -> tuple[str, ...]:
    """Registered precision names, in registration order ("bf16", "int8" first)."""
    return tuple(_BY_NAME)


def master() -> Precision:
    """The entry the host store keeps the model's own weights in (never derived)."""
    return _BY_NAME[FULL]


def layer_views(buf: torch.Tensor, lay: LayerLayout) -> tuple[torch.Tensor, ...]:
    """One layer's stored tensors as views of `buf` (host buffer or slot), for the layout's precision."""
    return by_code(lay.code).views(buf, lay)


FULL = register(FullPrecision()).name
INT8 = register(Int8PerRow()).name
FP8 = register(Fp8PerRow()).name
# Per-layer granularity: one low precision for a block's attention or its MLP only, the rest full.
for _code, (_low, _role) in enumerate([(INT8, ATTENTION), (INT8, MLP), (FP8, ATTENTION), (FP8, MLP)], start=3):
    register(ByRole(by_role_name(_low, _role), _code, attention=_BY_NAME[_low if _role == ATTENTION else FULL],
                    mlp=_BY_NAME[_low if _role == MLP else FULL]))
# Both roles low but in different precisions (the FP8 policy file chooses per layer shape).
for _code, (_attention, _mlp) in enumerate([(INT8, FP8), (FP8, INT8)], start=7):
    register(ByRole(by_roles_name(_attention, _mlp), _code, attention=_BY_NAME[_attention], mlp=_BY_NAME[_mlp]))
