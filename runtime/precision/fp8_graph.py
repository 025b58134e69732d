"""fp8's Linear as graph ops (see traced.py): E4M3 GEMMs on `_scaled_mm`, quantization by Inductor.

The arithmetic is `quantize_rows_ref`'s (the Triton kernel's twin) and fp8.py's
op path's: per-row E4M3 activations, the weight's row scale as the GEMM's
column scale in the forward and folded into dy in the grad-input.
"""

from __future__ import annotations

import torch

from torch_stagehand.kernels.fp8_quant import E4M3, quantize_rows_ref

from torch_stagehand.runtime.precision.layout import LayerLayout
from torch_stagehand.runtime.precision.traced import TracedLinear, TracedMath, cast_to, in_graph


def _views(slot: torch.Tensor, lay: LayerLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight [n, k], fp32 row scale [n]) inside the slot, as graph views (no copy)."""
    n, k = lay.out_features, lay.in_features
    q = slot[lay.offset : lay.offset + n * k].view(E4M3).view(n, k)
    s = slot[lay.scale_offset : lay.scale_offset + 4 * n].view(torch.float32)
    return q, s


def _forward(x: torch.Tensor, slot: torch.Tensor, lay: LayerLayout) -> torch.Tensor:
    q, s = _views(slot, lay)
    n, k = lay.out_features, lay.in_features
    xq, xs = quantize_rows_ref(x.reshape(-1, k))
    # Fast accumulation in the forward only, as in fp8.scaled_linear (the op path). Row-wise scaled
    # GEMMs return bf16 only.
    y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, n), out_dtype=torch.bfloat16, use_fast_accum=True)
    return cast_to(y, x.dtype).view(*x.shape[:-1], n)


def _grad_input(dy: torch.Tensor, slot: torch.Tensor, lay: LayerLayout) -> torch.Tensor:
    q, s = _views(slot, lay)
    n, k = lay.out_features, lay.in_features
    # The weight's row scale sits on the reduction dim here: it goes into dy before dy is quantized.
    dq, ds = quantize_rows_ref(dy.reshape(-1, n), col_scale=s)
    # Hopper's FP8 GEMMs are TN only: the second operand must be [n, k] column-major, i.e. W^T made
    # contiguous; moved as bytes (Inductor's tiled copy kernel), reinterpreted after.
    wt = q.view(torch.uint8).t().contiguous().view(E4M3)
    ones = torch.ones(1, k, dtype=torch.float32, device=dy.device)
    dx = torch._scaled_mm(dq, wt.t(), scale_a=ds, scale_b=ones, out_dtype=torch.bfloat16)
    return cast_to(dx, dy.dtype).view(*dy.shape[:-1], k)


FP8_MATH = TracedMath(_forward, _grad_input)


@in_graph
def fp8_linear_in_graph(x: torch.Tensor, slot: torch.Tensor, block_tok: torch.Tensor, prev_tok: torch.Tensor,
                        layout: list[int]) -> torch.Tensor:
    """y = x @ W^T for an fp8 layer of `slot`, as ops AOTAutograd traces into the block's graph (no bias)."""
    return TracedLinear.apply(x, slot, block_tok, prev_tok, tuple(layout), FP8_MATH)
