"""Per-layer precision inside a block: a *by-role* precision's buffer holds the block's attention projections in one
precision and the rest (the MLP) in another ("int8-mlp": attention bf16, MLP int8; "int8-attn+fp8-mlp").
Every layer's layout carries this entry's code (`wait_bw` takes the block's precision from it) and its role's
stored dtype, by which this entry hands each layer to the entry that stored it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from torch_stagehand.runtime.precision.base import Precision
from torch_stagehand.runtime.precision.layout import LayerLayout

if TYPE_CHECKING:
    from torch_stagehand.runtime.blocks import StreamedLayerSpec

ATTENTION, MLP = "attn", "mlp"
_ATTENTION_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj", "to_q", "to_k", "to_v", "to_out", "qkv", "c_attn",
                     "query", "key", "value", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"}


def layer_role(fqn: str) -> str:
    """ATTENTION for a layer of an attention module or an attention projection, else MLP."""
    parts = fqn.split(".")
    if any("attn" in p or "attention" in p for p in parts) or any(p in _ATTENTION_LEAVES for p in parts):
        return ATTENTION
    return MLP


class ByRole(Precision):
    def __init__(self, name: str, code: int, attention: Precision, mlp: Precision):
        self.name, self.code = name, code
        self.roles = {ATTENTION: attention, MLP: mlp}
        # A layer's stored dtype ("float" for the full precision) tells which role's entry wrote it: the two must
        # store different dtypes.
        self._by_stored = {entry.weight_dtype if entry.derived_from_master else _FLOAT: entry
                           for entry in (attention, mlp)}
        if len(self._by_stored) != 2:
            raise ValueError(f"by-role precision {name!r}: attention ({attention.name}) and MLP ({mlp.name}) "
                             "store the same dtype; use that precision for the whole block")

    def role_precision(self, role: str) -> str:
        return self.roles[role].name

    def _for(self, spec: "StreamedLayerSpec") -> Precision:
        return self.roles[layer_role(spec.fqn)]

    def _stored(self, lay: LayerLayout) -> Precision:
        """The entry that stored this layer, told by its stored dtype."""
        return self._by_stored[_FLOAT if lay.dtype in _FLOATS else lay.dtype]

    def layer_nbytes(self, spec):
        return self._for(spec).layer_nbytes(spec)

    def layer_layout(self, spec, offset, scale_offset):
        return dataclasses.replace(self._for(spec).layer_layout(spec, offset, scale_offset), code=self.code)

    def views(self, buf: torch.Tensor, lay: LayerLayout):
        return self._stored(lay).views(buf, lay)

    def write(self, buf, lay, weight, quantizer):
        self._stored(lay).write(buf, lay, weight, quantizer)

    def bias_in_graph(self, lay) -> bool:
        return self._stored(lay).bias_in_graph(lay)

    def graph_linear(self, lay, device, rows):
        return self._stored(lay).graph_linear(lay, device, rows)

    def linear_from_slot(self, x, slot, bias, lay):
        return self._stored(lay).linear_from_slot(x, slot, bias, lay)

    def grad_input_from_slot(self, dy, slot, lay):
        return self._stored(lay).grad_input_from_slot(dy, slot, lay)

    def check_device(self, device, emulate):
        for entry in self.roles.values():
            entry.check_device(device, emulate)


def by_role_name(low: str, role: str) -> str:
    """The by-role precision that stores `role` layers in `low` and the others in full precision."""
    return f"{low}-{role}"


def by_roles_name(attention: str, mlp: str) -> str:
    """The by-role precision with both roles in (different) low precisions: "int8-attn+fp8-mlp"."""
    return f"{attention}-{ATTENTION}+{mlp}-{MLP}"


_FLOAT = "float"
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
