"""fp8's Linear written in graph ops, for compiled blocks: Inductor sees the quantization and the GEMM.

Through the `stagehand::linear` op each fp8 Linear cost the host ~85 us in the
forward and ~170 us in its grad-input (the custom op's dispatch, the layout
parsed again, a Python launch per quantization and per transpose) against
~25 us for a cuBLAS GEMM; at workload A's 4096 tokens the host, not the GPU,
set the step time (benches/results/fp8_parts_h100.json, fp8_workload_a.json).
Traced into the block's own graph instead:

* the per-row quantization of the activation is Inductor's kernel, fused with
  what produced it (a norm, a modulation), and Linears that read the same
  input (q, k, v and the MLP's in-projection of a Flux block) share one, by
  AOTAutograd's common-subexpression pass;
* `aten._scaled_mm` is called straight from Inductor's generated code;
* the grad-input's transposed weight is one Inductor copy kernel.

The autograd.Function keeps the op path's contract to the letter: it saves the
block's tokens, never the slot; its backward asks for the block again with
`wait_bw` and prefetches the previous block, the very ops `stagehand::linear`'s
backward emits, so `schedule_backward` dedupes and closes them the same way.
The arithmetic is `quantize_rows_ref`'s (the Triton kernel's twin).
"""

from __future__ import annotations

import torch

from torch_stagehand.kernels.fp8_quant import E4M3, quantize_rows_ref

from .layout import LayerLayout


def _views(slot: torch.Tensor, lay: LayerLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight [n, k], fp32 row scale [n]) inside the slot, as graph views (no copy)."""
    n, k = lay.out_features, lay.in_features
    q = slot[lay.offset : lay.offset + n * k].view(E4M3).view(n, k)
    s = slot[lay.scale_offset : lay.scale_offset + 4 * n].view(torch.float32)
    return q, s


def _to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y if y.dtype == dtype else y.to(dtype)  # row-wise scaled GEMMs return bf16 only


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot, block_tok, prev_tok, layout):
        lay = LayerLayout.from_ints(list(layout))
        q, s = _views(slot, lay)
        n, k = lay.out_features, lay.in_features
        xq, xs = quantize_rows_ref(x.reshape(-1, k))
        # Fast accumulation in the forward only, as in fp8.scaled_linear (the op path).
        y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, n), out_dtype=torch.bfloat16,
                             use_fast_accum=True)
        ctx.layout, ctx.nbytes, ctx.device = tuple(layout), slot.numel(), slot.device
        ctx.save_for_backward(block_tok, prev_tok)  # the slot deliberately not: backward asks again
        return _to(y, x.dtype).view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        block_tok, prev_tok = ctx.saved_tensors
        lay = LayerLayout.from_ints(list(ctx.layout))
        slot = torch.ops.stagehand.wait_bw(block_tok, dy, ctx.nbytes, lay.code, ctx.device)
        torch.ops.stagehand.prefetch(prev_tok, [slot])  # the block whose backward runs next
        q, s = _views(slot, lay)
        n, k = lay.out_features, lay.in_features
        # The weight's row scale sits on the reduction dim here: it goes into dy before dy is quantized.
        dq, ds = quantize_rows_ref(dy.reshape(-1, n), col_scale=s)
        # Hopper's FP8 GEMMs are TN only: the second operand must be [n, k] column-major, i.e. W^T made
        # contiguous; moved as bytes (Inductor's tiled copy kernel), reinterpreted after.
        wt = q.view(torch.uint8).t().contiguous().view(E4M3)
        dx = torch._scaled_mm(dq, wt.t(), scale_a=ds, scale_b=torch.ones(1, k, dtype=torch.float32, device=dy.device),
                              out_dtype=torch.bfloat16)
        return _to(dx, dy.dtype).view(*dy.shape[:-1], k), None, None, None, None


def fp8_linear_in_graph(x: torch.Tensor, slot: torch.Tensor, block_tok: torch.Tensor, prev_tok: torch.Tensor,
                        layout: list[int]) -> torch.Tensor:
    """y = x @ W^T for an fp8 layer of `slot`, as ops AOTAutograd traces into the block's graph (no bias:
    the rewrite adds it in the graph)."""
    return _Fp8Linear.apply(x, slot, block_tok, prev_tok, tuple(layout))
