""""int8": per-row symmetric INT8 weights plus one fp32 scale per output row.

Built by quantizing the full-precision master (kernels.quantize_per_row, "mse"
or "absmax") or read from an INT8 slab; computed by the W8A16 kernels (fused
Triton on CUDA, the torch reference twin elsewhere). Half the bytes of bf16
over PCIe. Stored [out, in] whatever the module's layout: the quantizer and the
kernels work on rows of output features.
"""

from __future__ import annotations

import torch

from torch_stagehand import kernels

from .base import OneBytePerRow


class Int8PerRow(OneBytePerRow):
    name = "int8"
    code = 1
    weight_dtype = torch.int8

    def quantize(self, weight: torch.Tensor, quantizer: str) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.quantize_per_row(weight, method=quantizer)

    def linear_from_slot(self, x, slot, bias, lay):
        q, s = self.views(slot, lay)
        return kernels.int8_linear(x, q, s, bias)

    def grad_input_from_slot(self, dy, slot, lay):
        q, s = self.views(slot, lay)
        return kernels.int8_linear_grad_input(dy, q, s, lay.in_features)
