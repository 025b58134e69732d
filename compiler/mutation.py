"""Which values of a Dynamo graph are written in place, for passes that evaluate or fold graph values. Dynamo's graph
is not functional: `mask.logical_and_(keep)`, `m[..., :n] = x`, `out=` and in-place ops on views change a value with
no data edge to show it. Storage identity comes from Dynamo's fake values (a view shares its base's); a write whose
target has no fake value is `unplaced`: it may write anything."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from torch_stagehand.compiler.graph_nodes import example_value, node_arg

# `x op= y` on a tensor: Dynamo records the operator module's in-place function.
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
                      operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.imatmul, operator.setitem}
_INPLACE_DUNDERS = {f"__{op.__name__}__" for op in _INPLACE_OPERATORS}  # "__iadd__", ..., "__setitem__"


def storage_of(value: Any) -> StorageWeakRef | None:
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return StorageWeakRef(value.untyped_storage())
    except (NotImplementedError, RuntimeError):  # a tensor subclass without storage
        return None


def written_args(node: fx.Node) -> list[Any]:
    """The arguments `node` writes into."""
    written: list[Any] = []
    out = node.kwargs.get("out")
    if out is not None:
        written.extend(out if isinstance(out, (tuple, list)) else [out])
    if node.op == "call_method":
        name = node.target
        if _is_inplace_name(name) or name in _INPLACE_DUNDERS:
            written.append(node.args[0])
    elif node.op == "call_function":
        target = node.target
        if target in _INPLACE_OPERATORS:
            written.append(node.args[0])
        elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            written.extend(_schema_writes(node, target))
        elif _is_torch_callable(target) and _is_inplace_name(getattr(target, "__name__", "")) \
                or node.kwargs.get("inplace") is True:
            written.append(node.args[0])
        elif _calls_mutating_subgraph(node):
            written.extend(a for a in node.all_input_nodes if isinstance(example_value(a), torch.Tensor))
    elif node.op == "call_module":
        module = node.graph.owning_module.get_submodule(node.target) if node.graph.owning_module else None
        if getattr(module, "inplace", False):
            written.append(node.args[0])
    return [a for a in written if a is not None]


def _is_inplace_name(name: str) -> bool:
    """torch's convention: `mul_`, `masked_fill_`, `copy_` write their first argument; dunders do not count."""
    return name.endswith("_") and not name.startswith("__") and len(name) > 1


def _is_torch_callable(target) -> bool:
    """torch's functions and Tensor methods (`torch.relu_`, `Tensor.add_`), not `operator.and_` and the like."""
    module = getattr(target, "__module__", None) or ""
    return module.startswith("torch") or getattr(target, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase)


def _schema_writes(node: fx.Node, target) -> list[Any]:
    op = target.default if isinstance(target, torch._ops.OpOverloadPacket) and hasattr(target, "default") else target
    schema = getattr(op, "_schema", None)
    if schema is None:
        return []
    return [node_arg(node, i, arg.name) for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write]


def _calls_mutating_subgraph(node: fx.Node) -> bool:
    """A higher-order op whose body (a get_attr'd GraphModule) writes anything: its tensor inputs may be written."""
    owner = node.graph.owning_module
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and owner is not None:
            body = getattr(owner, arg.target, None)
            if isinstance(body, fx.GraphModule) and any(written_args(n) for n in body.graph.nodes):
                return True
    return False


@dataclass
class MutationIndex:
    """Every in-place write of a graph, by the storage it writes."""

    by_storage: dict[StorageWeakRef, list[fx.Node]] = field(default_factory=dict)
    unplaced: list[fx.Node] = field(default_factory=list)  # writes whose target's storage is not known

    @staticmethod
    def of(graph: fx.Graph) -> "MutationIndex":
        index = MutationIndex()
        for node in graph.nodes:
            for target in written_args(node):
                if not isinstance(target, fx.Node):
                    continue  # a constant cannot be written into
                key = storage_of(example_value(target))
                if key is None:
                    index.unplaced.append(node)
                else:
                    index.by_storage.setdefault(key, []).append(node)
        return index

    def writers(self, nodes: Iterable[fx.Node]) -> list[fx.Node]:
        """The nodes that write into the storage of any of `nodes` (or may: an unplaced write counts)."""
        found: dict[fx.Node, None] = dict.fromkeys(self.unplaced)
        for node in nodes:
            key = storage_of(example_value(node))
            if key is not None:
                found.update(dict.fromkeys(self.by_storage.get(key, ())))
        return list(found)


__all__ = ["MutationIndex", "storage_of", "written_args"]
