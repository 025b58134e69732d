"""Which layers of a model a slab covers, by which name, and the model signature over them.

A canonical name drops what wrappers insert (peft, LoRA's ``.orig``, ``_orig_mod``, checkpointing, FSDP), so a
slab of a plain model loads into it wrapped. The signature is SquareQ's: sha256 over the sorted
``"{name}:{in}:{out}:{has_bias}"`` joined by ``|``, first 16 hex digits, over the Linear-like layers
(`linear_like`) under ``include_prefixes``: SquareQ's number for a model without Conv1D and no prefixes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator

from torch import nn

from torch_stagehand.runtime.linear_like import is_adapter_path, is_conv1d

# Path segments that wrappers insert between a model and its Linear, dropped from the canonical name.
_WRAPPER_SEGMENTS = frozenset({"base_layer", "orig", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
_PEFT_PREFIX = "base_model.model."


def canonical_name(name: str) -> str:
    """Map a live module path back to the name a slab uses: drops peft's ``base_model.model.`` and wrapper segments."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class LinearInfo:
    name: str  # canonical
    module: nn.Module
    in_features: int
    out_features: int
    has_bias: bool
    layout: str  # "linear" | "conv1d"


def iter_linear_layers(model: nn.Module, include_prefixes: Iterable[str] | None = None) -> Iterator[LinearInfo]:
    """Linear-like layers of `model` by canonical name (the first of two names wins), filtered by prefix."""
    prefixes = None if include_prefixes is None else tuple(include_prefixes)
    seen: set[str] = set()
    for mname, m in model.named_modules():
        if is_adapter_path(mname):
            continue
        if isinstance(m, nn.Linear):
            layout, fin, fout = "linear", m.in_features, m.out_features
        elif is_conv1d(m):
            layout, fin, fout = "conv1d", int(m.weight.shape[0]), int(m.weight.shape[1])
        else:
            continue
        cname = canonical_name(mname)
        if cname in seen or (prefixes is not None and not cname.startswith(prefixes)):
            continue
        seen.add(cname)
        yield LinearInfo(cname, m, fin, fout, getattr(m, "bias", None) is not None, layout)


def signature_from_shapes(entries: Iterable[tuple[str, int, int, bool]]) -> str:
    """SquareQ's signature over (name, in_features, out_features, has_bias)."""
    items = sorted(f"{n}:{i}:{o}:{b}" for n, i, o, b in entries)
    return hashlib.sha256("|".join(items).encode()).hexdigest()[:16]


def compute_model_signature(model: nn.Module, include_prefixes: Iterable[str] | None = None) -> str:
    """Signature of the Linear-like layers under `include_prefixes` (None: all); equals SquareQ's
    `compute_model_signature(model)` for a model without Conv1D."""
    return signature_from_shapes((li.name, li.in_features, li.out_features, li.has_bias)
                                 for li in iter_linear_layers(model, include_prefixes))
