""""int8": per-row symmetric INT8 weights plus one fp32 scale per output row.

Built by quantizing the full-precision master (kernels.quantize_per_row, "mse"
or "absmax") or read from an INT8 slab; computed by the W8A16 kernels (fused
Triton on CUDA, the torch reference twin elsewhere). Half the bytes of bf16
over PCIe. Stored [out, in] whatever the module's layout: the quantizer and the
kernels work on rows of output features.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torch_stagehand import kernels

from .base import Precision
from .layout import DTYPE_CODES, LayerLayout

if TYPE_CHECKING:
    from ..blocks import StreamedLayerSpec


class Int8PerRow(Precision):
    name = "int8"
    code = 1
    derived_from_master = True

    def layer_nbytes(self, spec: "StreamedLayerSpec") -> tuple[int, int]:
        return spec.out_features * spec.in_features, 4 * spec.out_features

    def layer_layout(self, spec: "StreamedLayerSpec", offset: int, scale_offset: int) -> LayerLayout:
        return LayerLayout(
            self.code, offset, spec.out_features, spec.in_features, scale_offset, False, DTYPE_CODES[torch.int8]
        )

    def views(self, buf: torch.Tensor, lay: LayerLayout) -> tuple[torch.Tensor, ...]:
        n, k = lay.out_features, lay.in_features
        q = buf[lay.offset : lay.offset + n * k].view(torch.int8).view(n, k)
        s = buf[lay.scale_offset : lay.scale_offset + 4 * n].view(torch.float32)
        return q, s

    def write(self, buf: torch.Tensor, lay: LayerLayout, weight: torch.Tensor, quantizer: str) -> None:
        q, s = kernels.quantize_per_row(weight, method=quantizer)
        q_view, s_view = self.views(buf, lay)
        q_view.copy_(q)
        s_view.copy_(s)

    def linear_from_slot(self, x, slot, bias, lay):
        q, s = self.views(slot, lay)
        return kernels.int8_linear(x, q, s, bias)

    def grad_input_from_slot(self, dy, slot, lay):
        q, s = self.views(slot, lay)
        return kernels.int8_linear_grad_input(dy, q, s, lay.in_features)
