"""What a precision is: the one interface the host store, the ops and the runtime talk to. How a precision stores
and computes a weight (layout, buffer filling, views in a host buffer or a slot, the math) lives in its entry;
callers never branch on which precision it is."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable

import torch

from torch_stagehand.runtime.host.copy import copy_to_host
from torch_stagehand.runtime.precision.layout import DTYPE_CODES, LayerLayout, align

if TYPE_CHECKING:
    from torch_stagehand.runtime.blocks import StreamedLayerSpec


class Precision(abc.ABC):
    """One streamed precision. Subclasses set the three class attributes and the methods below."""

    name: str  # what precision maps, the CLI and telemetry say ("bf16", "int8")
    code: int  # the small int that travels in op schemas and layouts
    # Built from the master (rebuilt when its version counter moves); False only for the master itself.
    derived_from_master: bool = True

    def bias_in_graph(self, lay: LayerLayout) -> bool:
        """Should this layer's bias be its own add in the graph (fused by Inductor), not the linear op's?"""
        return False

    def graph_linear(self, lay: LayerLayout, device: torch.device, rows: int | None) -> "Callable | None":
        """This layer's linear in graph ops, `(x, slot, block_tok, prev_tok, layout) -> y` without bias, traced
        into compiled blocks instead of the op (precision/traced.py); None: the op. `rows`: the activation's rows
        where the captured graph knows them."""
        return None

    @abc.abstractmethod
    def layer_nbytes(self, spec: "StreamedLayerSpec") -> tuple[int, int]:
        """(weight bytes, scale bytes) of one layer; scale bytes 0 for no scale."""

    @abc.abstractmethod
    def layer_layout(self, spec: "StreamedLayerSpec", offset: int, scale_offset: int) -> LayerLayout:
        ...

    def layout(self, layers: list["StreamedLayerSpec"]) -> tuple[list[LayerLayout], int]:
        """Each layer's place in the block's flat buffer (ALIGN-aligned), and the buffer's size."""
        result, offset = [], 0
        for spec in layers:
            weight_bytes, scale_bytes = self.layer_nbytes(spec)
            scale_offset = align(offset + weight_bytes) if scale_bytes else -1
            result.append(self.layer_layout(spec, offset, scale_offset))
            offset = align(scale_offset + scale_bytes) if scale_bytes else align(offset + weight_bytes)
        return result, offset

    @abc.abstractmethod
    def views(self, buf: torch.Tensor, lay: LayerLayout) -> tuple[torch.Tensor, ...]:
        """The layer's stored tensors as views of `buf` (weight first, in its stored orientation)."""

    @abc.abstractmethod
    def write(self, buf: torch.Tensor, lay: LayerLayout, weight: torch.Tensor, quantizer: str) -> None:
        """Fill the layer's bytes in `buf` from a full-precision [out, in] weight."""

    @abc.abstractmethod
    def linear_from_slot(self, x: torch.Tensor, slot: torch.Tensor, bias: torch.Tensor | None,
                         lay: LayerLayout) -> torch.Tensor:
        ...

    @abc.abstractmethod
    def grad_input_from_slot(self, dy: torch.Tensor, slot: torch.Tensor, lay: LayerLayout) -> torch.Tensor:
        ...

    def check_device(self, device: torch.device, emulate: bool) -> None:
        """Raise if this precision cannot compute on `device` (`emulate`: the user allowed an emulation)."""

    def __repr__(self) -> str:
        return f"<precision {self.name!r} code {self.code}>"


def row_views(buf: torch.Tensor, lay: LayerLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-byte-per-row layer's (weight [out, in] of `dtype`, fp32 row scale [out]) as views of `buf`."""
    n, k = lay.out_features, lay.in_features
    q = buf[lay.offset : lay.offset + n * k].view(dtype).view(n, k)
    return q, buf[lay.scale_offset : lay.scale_offset + 4 * n].view(torch.float32)


class OneBytePerRow(Precision):
    """One byte per weight plus one fp32 scale per output row, stored [out, in] ("int8", "fp8")."""

    weight_dtype: torch.dtype

    def layer_nbytes(self, spec: "StreamedLayerSpec") -> tuple[int, int]:
        return spec.out_features * spec.in_features, 4 * spec.out_features

    def layer_layout(self, spec: "StreamedLayerSpec", offset: int, scale_offset: int) -> LayerLayout:
        return LayerLayout(self.code, offset, spec.out_features, spec.in_features, scale_offset, False,
                           DTYPE_CODES[self.weight_dtype])

    def views(self, buf: torch.Tensor, lay: LayerLayout) -> tuple[torch.Tensor, ...]:
        return row_views(buf, lay, self.weight_dtype)

    @abc.abstractmethod
    def quantize(self, weight: torch.Tensor, quantizer: str) -> tuple[torch.Tensor, torch.Tensor]:
        """[out, in] full-precision weight -> (one-byte rows, fp32 scale per row)."""

    def write(self, buf: torch.Tensor, lay: LayerLayout, weight: torch.Tensor, quantizer: str) -> None:
        q, s = self.quantize(weight, quantizer)
        q_view, s_view = self.views(buf, lay)
        copy_to_host(q_view, q)  # quantized on the GPU (HostStore.quant_device): staged through pinned memory
        copy_to_host(s_view, s)
