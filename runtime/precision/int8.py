""""int8": per-row symmetric INT8 weights plus one fp32 scale per output row, stored [out, in] whatever the
module's layout; quantized from the master (kernels.quantize_per_row) or read from a slab; computed by the W8A16
kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_stagehand import kernels
from torch_stagehand.runtime.precision.base import OneBytePerRow, row_views
from torch_stagehand.runtime.precision.traced import TracedLinear, TracedMath, in_graph

# From this many rows up the autotuner picks dequantize + cuBLAS: aten ops, traced into compiled blocks.
TRACED_MIN_ROWS = 513


class Int8PerRow(OneBytePerRow):
    name = "int8"
    code = 1
    weight_dtype = torch.int8

    def quantize(self, weight: torch.Tensor, quantizer: str) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.quantize_per_row(weight, method=quantizer)

    def graph_linear(self, lay, device, rows):
        # A known, large row count only: below it the fused kernels win, and a symbolic one may be small.
        return int8_linear_in_graph if rows is not None and rows >= TRACED_MIN_ROWS else None

    def linear_from_slot(self, x, slot, bias, lay):
        return kernels.int8_linear(x, *self.views(slot, lay), bias)

    def grad_input_from_slot(self, dy, slot, lay):
        return kernels.int8_linear_grad_input(dy, *self.views(slot, lay), lay.in_features)


def _dequantized(slot: torch.Tensor, lay, dtype: torch.dtype) -> torch.Tensor:
    return kernels.dequantize(*row_views(slot, lay, torch.int8), dtype)  # one Inductor kernel, as the op's dequant mode


def _forward(x: torch.Tensor, slot: torch.Tensor, lay) -> torch.Tensor:
    return F.linear(x, _dequantized(slot, lay, x.dtype))


def _grad_input(dy: torch.Tensor, slot: torch.Tensor, lay) -> torch.Tensor:
    return dy @ _dequantized(slot, lay, dy.dtype)


INT8_MATH = TracedMath(_forward, _grad_input)


@in_graph
def int8_linear_in_graph(x: torch.Tensor, slot: torch.Tensor, block_tok: torch.Tensor, prev_tok: torch.Tensor,
                         layout: list[int]) -> torch.Tensor:
    """y = x @ dequantize(W)^T for an int8 layer of `slot`, as ops AOTAutograd traces into the block's graph."""
    return TracedLinear.apply(x, slot, block_tok, prev_tok, tuple(layout), INT8_MATH)
