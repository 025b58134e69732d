"""Process-wide lookup from the values that travel through graphs to runtimes.

A block is named by its *block token*: a 0-dim int64 CPU tensor holding `runtime_id << 32 | block`. Every streamed
Linear hands its block's token to `streamed_linear` with its position in the block, so Dynamo lifts the token to a
graph input (guarded by its metadata, not its value): identical blocks share one Dynamo graph. A global layer id
names a layer from Python (a parameter back to its runtime).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

Runtime = Any  # the registry sits below runtime.Runtime and never imports it

NO_BLOCK = -1
_runtime_ids = itertools.count(1)
_layer_ids = itertools.count(0)
_runtimes: "weakref.WeakValueDictionary[int, Runtime]" = weakref.WeakValueDictionary()
_layers: dict[int, tuple[int, int]] = {}  # layer id -> (runtime id, index in runtime.layers)
_tokens: dict[int, tuple[torch.Tensor, int]] = {}  # id(token) -> (the token, its runtime id): a backend's lookup


def register_runtime(rt: "Runtime") -> int:
    rid = next(_runtime_ids)
    _runtimes[rid] = rt
    return rid


def unregister_runtime(rid: int) -> None:
    _runtimes.pop(rid, None)
    for lid in [lid for lid, (r, _) in _layers.items() if r == rid]:
        del _layers[lid]
    for key in [key for key, (_, r) in _tokens.items() if r == rid]:
        del _tokens[key]


def has_runtimes() -> bool:
    """Whether any offloaded model is live (the backend warns when compiling with none)."""
    return len(_runtimes) > 0


def new_layer_id(rid: int, index: int) -> int:
    lid = next(_layer_ids)
    _layers[lid] = (rid, index)
    return lid


def layer(layer_id: int) -> tuple["Runtime", int]:
    try:
        rid, index = _layers[layer_id]
        return _runtimes[rid], index
    except KeyError:
        raise RuntimeError(f"stagehand: streamed layer id {layer_id} belongs to no live runtime "
                           "(was the model restored or its Runtime closed?)") from None


def make_token(rid: int, block: int) -> torch.Tensor:
    value = NO_BLOCK if block == NO_BLOCK else (rid << 32) | block
    token = torch.tensor(value, dtype=torch.int64)
    _tokens[id(token)] = (token, rid)
    return token


def token_owner(value: Any) -> tuple["Runtime", int] | None:
    """(runtime, block) when `value` is one of a live runtime's block tokens (the object itself, as a
    compiled graph's example input is), else None."""
    entry = _tokens.get(id(value))
    if entry is None or entry[0] is not value or int(value) == NO_BLOCK:
        return None
    rt = _runtimes.get(entry[1])
    return None if rt is None else (rt, int(value) & 0xFFFFFFFF)


def decode(token: torch.Tensor) -> tuple["Runtime | None", int]:
    value = int(token)  # a CPU scalar: no device sync
    if value == NO_BLOCK:
        return None, NO_BLOCK
    rid, block = value >> 32, value & 0xFFFFFFFF
    rt = _runtimes.get(rid)
    if rt is None:
        raise RuntimeError(f"stagehand: block {block} belongs to no live runtime (runtime {rid}: was the model "
                           "restored or its Runtime closed?)")
    return rt, block
