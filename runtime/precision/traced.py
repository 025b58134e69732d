"""A precision's Linear in graph ops for compiled blocks (`Precision.graph_linear`): Inductor then fuses the
quantization and calls the GEMM from its own code, without the `stagehand::linear` op's host cost.
`TracedLinear` keeps the op's contract: it saves the block's tokens, never the slot; its backward asks for the
block again (`wait_bw`) and prefetches the previous one. A precision supplies a `TracedMath`."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from torch_stagehand.runtime.precision.layout import LayerLayout


# The functions rewrite_linear puts in a variant graph: the compile caches key them by name (compile_cache.py).
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
