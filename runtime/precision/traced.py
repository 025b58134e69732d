"""A precision's Linear written in graph ops, for compiled blocks: the inner compiler sees the math.

Through the `stagehand::linear` op every streamed Linear pays the host for the
custom op's dispatch, the layout parsed again and the kernels launched from
Python: an fp8 Linear cost ~85 us to issue forward and ~170 us for its
grad-input against ~25 us for a cuBLAS GEMM, and at 4096 tokens the host, not
the GPU, set workload A's step (benches/results/fp8_parts_h100.json,
fp8_workload_a.json). A precision whose math is aten ops (`Precision.graph_linear`)
is traced into the block's own graph instead, and Inductor

* fuses the activation's per-row quantization (fp8) with what produced it, and
  Linears that read the same input (q, k, v, the MLP's in-projection) share one
  by AOTAutograd's common-subexpression pass;
* writes the weight's dequantization (int8 at many rows) or transpose (fp8's
  grad-input) as one kernel of its own;
* calls the GEMM (`_scaled_mm`, `mm`) straight from its generated code.

`TracedLinear` keeps the op path's contract to the letter: it saves the block's
tokens, never the slot; its backward asks for the block again with `wait_bw`
and prefetches the previous block, the very ops `stagehand::linear`'s backward
emits, so `schedule_backward` dedupes and closes them the same way. Each
precision gives its math as a `TracedMath`: `forward(x, slot, lay) -> y` (no
bias: the rewrite adds it in the graph) and `grad_input(dy, slot, lay) -> dx`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from torch_stagehand.runtime.precision.layout import LayerLayout


# The Python functions rewrite_linear puts in a variant graph (each calls TracedLinear with its math): the
# compile caches must be told they are safe to key by name (compiler/startup/compile_cache.py).
IN_GRAPH_FUNCTIONS: list[Callable] = []


def in_graph(fn: Callable) -> Callable:
    """Register a precision's in-graph linear (`Precision.graph_linear` returns it)."""
    IN_GRAPH_FUNCTIONS.append(fn)
    return fn


class TracedMath(NamedTuple):
    forward: Callable[[torch.Tensor, torch.Tensor, LayerLayout], torch.Tensor]
    grad_input: Callable[[torch.Tensor, torch.Tensor, LayerLayout], torch.Tensor]


class TracedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot, block_tok, prev_tok, layout, math):
        ctx.layout, ctx.nbytes, ctx.device, ctx.math = tuple(layout), slot.numel(), slot.device, math
        ctx.save_for_backward(block_tok, prev_tok)  # the slot deliberately not: backward asks again
        return math.forward(x, slot, LayerLayout.from_ints(list(layout)))

    @staticmethod
    def backward(ctx, dy):
        block_tok, prev_tok = ctx.saved_tensors
        lay = LayerLayout.from_ints(list(ctx.layout))
        slot = torch.ops.stagehand.wait_bw(block_tok, dy, ctx.nbytes, lay.code, ctx.device)
        torch.ops.stagehand.prefetch(prev_tok, [slot])  # the block whose backward runs next
        return ctx.math.grad_input(dy, slot, lay), None, None, None, None, None


def cast_to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y if y.dtype == dtype else y.to(dtype)
