"""fp8's Linear as graph ops (see traced.py): E4M3 GEMMs on `_scaled_mm`, the quantization by Inductor, with the
op path's arithmetic (fp8.py)."""

from __future__ import annotations

import torch

from torch_stagehand.kernels.fp8_quant import E4M3, quantize_rows_ref
from torch_stagehand.runtime.precision.base import row_views
from torch_stagehand.runtime.precision.layout import LayerLayout
from torch_stagehand.runtime.precision.traced import TracedLinear, TracedMath, cast_to, in_graph


def scaled_forward(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, quantize=quantize_rows_ref) -> torch.Tensor:
    """y = x @ (q * s)^T (no bias) on FP8 tensor cores, x quantized per row by `quantize`."""
    n, k = q.shape
    xq, xs = quantize(x.reshape(-1, k))
    # Fast accumulation in the forward only (the grad-input's reductions are long); bf16 out only (row-wise).
    y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, n), out_dtype=torch.bfloat16, use_fast_accum=True)
    return cast_to(y, x.dtype).view(*x.shape[:-1], n)


def scaled_backward(dy: torch.Tensor, q: torch.Tensor, s: torch.Tensor, ones: torch.Tensor,
                    quantize=quantize_rows_ref, transpose=None) -> torch.Tensor:
    """dx = dy @ (q * s) on FP8 tensor cores: the row scale (the reduction dim) goes into dy before it is
    quantized; `ones`: the unit [1, k] column scale; `transpose`: q -> q^T contiguous (default: torch's copy)."""
    n, k = q.shape
    dq, ds = quantize(dy.reshape(-1, n), col_scale=s)
    # Hopper's FP8 GEMMs are TN only: W^T made contiguous (moved as bytes), reinterpreted after.
    wt = transpose(q) if transpose is not None else q.view(torch.uint8).t().contiguous().view(E4M3)
    dx = torch._scaled_mm(dq, wt.t(), scale_a=ds, scale_b=ones, out_dtype=torch.bfloat16)
    return cast_to(dx, dy.dtype).view(*dy.shape[:-1], k)


def _forward(x: torch.Tensor, slot: torch.Tensor, lay: LayerLayout) -> torch.Tensor:
    return scaled_forward(x, *row_views(slot, lay, E4M3))


def _grad_input(dy: torch.Tensor, slot: torch.Tensor, lay: LayerLayout) -> torch.Tensor:
    ones = torch.ones(1, lay.in_features, dtype=torch.float32, device=dy.device)
    return scaled_backward(dy, *row_views(slot, lay, E4M3), ones)


FP8_MATH = TracedMath(_forward, _grad_input)


@in_graph
def fp8_linear_in_graph(x: torch.Tensor, slot: torch.Tensor, block_tok: torch.Tensor, prev_tok: torch.Tensor,
                        layout: list[int]) -> torch.Tensor:
    """y = x @ W^T for an fp8 layer of `slot`, as ops AOTAutograd traces into the block's graph (no bias)."""
    return TracedLinear.apply(x, slot, block_tok, prev_tok, tuple(layout), FP8_MATH)
