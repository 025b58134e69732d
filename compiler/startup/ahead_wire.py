"""What travels between the main process and an ahead-compile worker: length-prefixed pickles on the worker's
stdin and stdout, a variant graph node by node (torch's GraphPickler, our in-graph functions by name), and a
description of its inputs that the worker fakes again."""

from __future__ import annotations

import contextlib
import copy
import pickle
import struct
import types
from typing import Any, BinaryIO, Sequence

import torch
import torch.fx as fx
from torch.fx._graph_pickler import _OpPickleData


def send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    """The next message, or None when the other side closed the stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


# Node metadata a worker does without: module stacks (they hold the model's modules).
_UNSHIPPED_META = frozenset({"nn_module_stack", "source_fn_stack", "fwd_source_fn_stack", "grapharg",
                             "unbacked_bindings"})


def _as_meta(value: Any) -> Any:
    """A fake value as a meta tensor of the same sizes and strides (a static unit's have int sizes)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_as_meta(v) for v in value)
    return value


def pickle_graph(gm: fx.GraphModule) -> bytes:
    """`gm` node by node (torch's GraphPickler: a plain pickle retraces the code, not the same graph), our ops
    included. Fake values travel as meta tensors (their ShapeEnv does not pickle)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    shipped = copy.deepcopy(gm)
    for node in shipped.graph.nodes:
        for key in ("example_value", "val"):
            if key in node.meta:
                node.meta[key] = _as_meta(node.meta[key])
    with _our_functions_by_name():
        return GraphPickler.dumps(shipped, Options(ops_filter=None,
                                                   node_metadata_key_filter=lambda k: k not in _UNSHIPPED_META))


class _FunctionByName(_OpPickleData):
    """A function of ours a graph calls (the in-graph Linears), shipped by module and name (GraphPickler ships
    only ops and torch's functions); the worker imports it."""

    def __init__(self, module: str, qualname: str):
        self.module, self.qualname = module, qualname

    def unpickle(self, unpickle_state: Any) -> object:
        import importlib

        target: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return target


@contextlib.contextmanager
def _our_functions_by_name():
    """GraphPickler's target pickling, taught our functions (`_FunctionByName`) while `pickle_graph` runs."""
    original = _OpPickleData.__dict__["pickle"]

    def pickle_target(cls, op, options):
        if isinstance(op, types.FunctionType) and op.__module__.startswith("torch_stagehand."):
            return _FunctionByName(op.__module__, op.__qualname__)
        return original.__func__(cls, op, options)

    _OpPickleData.pickle = classmethod(pickle_target)
    try:
        yield
    finally:
        _OpPickleData.pickle = original


def input_specs(args: Sequence[Any]) -> list:
    """What a worker needs to fake a variant's inputs as the main process will: per tensor its storage group,
    size, strides, offset, dtype, device and grad flag; a 0-dim CPU tensor and any other value as they are."""
    storages: dict[tuple, int] = {}
    specs: list = []
    for a in args:
        if isinstance(a, torch.Tensor) and not (a.dim() == 0 and a.device.type == "cpu"):
            storage = a.untyped_storage()
            group = storages.setdefault((storage.data_ptr(), str(a.device)), len(storages))
            specs.append(("tensor", group, storage.nbytes(), tuple(a.shape), a.stride(), a.storage_offset(), a.dtype,
                          str(a.device), a.requires_grad))
        else:
            specs.append(("value", a.detach().clone() if isinstance(a, torch.Tensor) else a))
    return specs
