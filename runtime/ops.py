"""The stagehand custom ops: what the rewritten graphs are made of.

`streamed_linear(x, bias, block_tok, position, out_features)` is what a streamed module's forward calls, so it is
what Dynamo captures; run eagerly it fetches the layer's block on demand (slow but correct). The backend rewrites
it into the scheduled ops, ordered by data through tokens so any inner compiler may reorder freely:

    fetch = prefetch(block_tok, after=[...])      # H2D copy on the side stream
    slot  = wait(fetch, block_tok, nbytes, prec)   # compute stream waits on it
    y     = linear(x, slot, bias, block_tok, prev_tok, layout)
    free  = evict(block_tok, slot, readers=[y, ...], prec)

`linear` saves no weight for backward: its backward asks for the block again with `wait_bw` (and prefetches the
block whose backward runs next). Block tokens are 0-dim int64 CPU tensors (registry.py); the ordering-only ops
are side-effectful so dead-code elimination keeps them.
"""

from __future__ import annotations

import functools

import torch
from torch.library import custom_op

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime import registry
from torch_stagehand.runtime.precision import LayerLayout


def _op(name: str, fake, side_effect: bool = False):
    """The decorated function as the custom op `stagehand::name`, with `fake` its shapes under tracing; an
    ordering-only op is `side_effect`: FX/AOT's and Inductor's dead-code elimination keep it."""
    def make(fn):
        op = custom_op(f"stagehand::{name}", mutates_args=())(fn)
        op.register_fake(fake)
        if side_effect:
            torch.fx.node.has_side_effect(getattr(torch.ops.stagehand, name).default)
        return op

    return make


# The math on a slot: the layout's code names the precision that computes it.
def linear_from_slot(x: torch.Tensor, slot: torch.Tensor, bias: torch.Tensor | None, layout: list[int]) -> torch.Tensor:
    lay = LayerLayout.from_ints(layout)
    return precisions.by_code(lay.code).linear_from_slot(x, slot, bias, lay)


def grad_input_from_slot(dy: torch.Tensor, slot: torch.Tensor, layout: list[int]) -> torch.Tensor:
    lay = LayerLayout.from_ints(layout)
    return precisions.by_code(lay.code).grad_input_from_slot(dy, slot, lay)


def _bias_grad(dy: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return dy.reshape(-1, dy.shape[-1]).sum(0).to(bias.dtype)


def _linear_out(x: torch.Tensor, n_out: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n_out)


def _token_out(*_) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


def _slot_out(_tok, _tok_or_anchor, nbytes, precision, device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


@_op("streamed_linear", lambda x, bias, block_tok, position, out_features, anchor=None: _linear_out(x, out_features))
def streamed_linear(x: torch.Tensor, bias: torch.Tensor | None, block_tok: torch.Tensor, position: int,
                    out_features: int, anchor: torch.Tensor | None = None) -> torch.Tensor:
    """The `position`-th streamed Linear of the block `block_tok` names. `anchor`: the block's grad anchor
    (train/grads.py); it requires grad when the layer's weight may train. Nothing here names one layer of one
    block as a constant, so every block of a structure captures the same graph."""
    rt, index = _layer_of(block_tok, position)
    return rt.eager_linear(index, x, bias)


def _layer_of(block_tok: torch.Tensor, position: int):
    """(runtime, index in runtime.layers) of a block's `position`-th streamed layer."""
    rt, block = registry.decode(block_tok)
    if rt is None:
        raise RuntimeError("stagehand: a streamed linear was called with the no-block token")
    return rt, rt.layer_at(block, position)


@_op("streamed_linear_grad_input", lambda dy, block_tok, position, in_features: _linear_out(dy, in_features))
def streamed_linear_grad_input(dy: torch.Tensor, block_tok: torch.Tensor, position: int,
                               in_features: int) -> torch.Tensor:
    rt, index = _layer_of(block_tok, position)
    return rt.eager_grad_input(index, dy)


@_op("streamed_linear_grad_weight", _token_out, side_effect=True)
def streamed_linear_grad_weight(dy: torch.Tensor, x: torch.Tensor, block_tok: torch.Tensor, position: int) -> torch.Tensor:
    """The layer's weight gradient, computed and sent to its host buffer (train/grads.py); returns a token.
    Nothing when the layer does not train (decided at run time: a traced call sees no token value)."""
    rt, index = _layer_of(block_tok, position)
    if rt.grads.trainable(index):
        rt.grads.grad_weight(index, dy, x)
    return registry_sentinel()


def _may_train(block_tok: torch.Tensor, position: int, anchor: torch.Tensor | None) -> bool:
    """Does the layer's weight take a gradient? The anchor says whether any of its block's may; a real
    token says which (under a tracing backend the token is a fake or functional tensor: keep the input, the
    op decides when it runs)."""
    if anchor is None or not anchor.requires_grad:
        return False
    if type(block_tok) is not torch.Tensor or block_tok.is_meta:  # fake, functional: traced, no value to read
        return True
    rt, index = _layer_of(block_tok, position)
    return rt.grads.trainable(index)


def _streamed_setup(ctx, inputs, output):
    x, bias, block_tok, position, _out_features, anchor = inputs
    ctx.position, ctx.in_features = position, x.shape[-1]
    ctx.bias_needs_grad = bias is not None and bias.requires_grad
    ctx.weight_trains = _may_train(block_tok, position, anchor)
    ctx.save_for_backward(block_tok, *([bias] if ctx.bias_needs_grad else []), *([x] if ctx.weight_trains else []))


def _streamed_backward(ctx, dy):
    block_tok, *saved = ctx.saved_tensors
    bias = saved.pop(0) if ctx.bias_needs_grad else None
    dx = (torch.ops.stagehand.streamed_linear_grad_input(dy, block_tok, ctx.position, ctx.in_features)
          if ctx.needs_input_grad[0] else None)
    if ctx.weight_trains:  # after the grad-input: a host optimizer may step the weight once its gradient lands
        torch.ops.stagehand.streamed_linear_grad_weight(dy, saved.pop(0), block_tok, ctx.position)
    dbias = _bias_grad(dy, bias) if ctx.bias_needs_grad else None
    return dx, dbias, None, None, None, None


streamed_linear.register_autograd(_streamed_backward, setup_context=_streamed_setup)


@_op("prefetch", _token_out, side_effect=True)
def prefetch(block_tok: torch.Tensor, after: list[torch.Tensor]) -> torch.Tensor:
    rt, block = registry.decode(block_tok)
    return registry_sentinel() if rt is None else rt.op_prefetch(block)


@_op("wait", _slot_out)
def wait(fetch_tok: torch.Tensor, block_tok: torch.Tensor, nbytes: int, precision: int, device: torch.device) -> torch.Tensor:
    rt, block = registry.decode(block_tok)
    return rt.op_wait(block, precision, nbytes, backward=False)


@_op("wait_bw", _slot_out)
def wait_bw(block_tok: torch.Tensor, anchor: torch.Tensor, nbytes: int, precision: int, device: torch.device) -> torch.Tensor:
    rt, block = registry.decode(block_tok)
    return rt.op_wait(block, precision, nbytes, backward=True)


@_op("evict", _token_out, side_effect=True)
def evict(block_tok: torch.Tensor, slot: torch.Tensor, readers: list[torch.Tensor], precision: int) -> torch.Tensor:
    rt, block = registry.decode(block_tok)
    return rt.op_release(block, precision)


@_op("linear", lambda x, slot, bias, block_tok, prev_tok, layout:
     _linear_out(x, LayerLayout.from_ints(layout).out_features))
def linear(x: torch.Tensor, slot: torch.Tensor, bias: torch.Tensor | None, block_tok: torch.Tensor,
           prev_tok: torch.Tensor, layout: list[int]) -> torch.Tensor:
    return linear_from_slot(x, slot, bias, layout)


@_op("linear_grad_input", lambda dy, slot, layout: _linear_out(dy, LayerLayout.from_ints(layout).in_features))
def linear_grad_input(dy: torch.Tensor, slot: torch.Tensor, layout: list[int]) -> torch.Tensor:
    return grad_input_from_slot(dy, slot, layout)


def _linear_setup(ctx, inputs, output):
    x, slot, bias, block_tok, prev_tok, layout = inputs
    # The slot is deliberately NOT saved: backward asks for the block again.
    ctx.layout, ctx.nbytes, ctx.device = layout, slot.numel(), slot.device
    ctx.bias_needs_grad = bias is not None and bias.requires_grad
    ctx.save_for_backward(block_tok, prev_tok, *([bias] if ctx.bias_needs_grad else []))


def _linear_backward(ctx, dy):
    block_tok, prev_tok, *bias = ctx.saved_tensors
    precision = ctx.layout[0]
    slot = torch.ops.stagehand.wait_bw(block_tok, dy, ctx.nbytes, precision, ctx.device)
    # Fetch the block whose backward runs next while this one computes.
    torch.ops.stagehand.prefetch(prev_tok, [slot])
    dx = torch.ops.stagehand.linear_grad_input(dy, slot, ctx.layout)
    dbias = _bias_grad(dy, bias[0]) if ctx.bias_needs_grad else None
    return dx, None, dbias, None, None, None


linear.register_autograd(_linear_backward, setup_context=_linear_setup)


@_op("grad_weight", _token_out, side_effect=True)
def grad_weight(dy: torch.Tensor, x: torch.Tensor, block_tok: torch.Tensor, position: int) -> torch.Tensor:
    """In a compiled block's backward: the weight gradient of the block's `position`-th streamed layer,
    computed and sent to its host buffer (train/grads.py). Returns a token nothing reads (kept: side effect)."""
    rt, block = registry.decode(block_tok)
    rt.grads.grad_weight_at(block, position, dy, x)
    return registry_sentinel()


class GradTap(torch.autograd.Function):
    """`y = tap(linear(x, slot, ...), x, anchor)`: the identity forward; in backward, the weight gradient, in the
    block's compiled backward beside the grad-input (rewrite_linear puts it after each Linear whose weight trains).
    It saves the Linear's input, never the slot; `anchor` makes autograd run this backward even when nothing
    upstream requires grad."""

    @staticmethod
    def forward(ctx, y, x, anchor, block_tok, position):
        ctx.position = position
        ctx.save_for_backward(x, block_tok)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        x, block_tok = ctx.saved_tensors
        torch.ops.stagehand.grad_weight(dy, x, block_tok, ctx.position)
        return dy, None, None, None, None


def grad_tap(y: torch.Tensor, x: torch.Tensor, anchor: torch.Tensor, block_tok: torch.Tensor,
             position: int) -> torch.Tensor:
    return GradTap.apply(y, x, anchor, block_tok, position)


@functools.cache
def registry_sentinel() -> torch.Tensor:
    """The token a no-op prefetch returns (allocated once)."""
    return torch.tensor(registry.NO_BLOCK, dtype=torch.int64)


SCHEDULE_OPS = {name: getattr(torch.ops.stagehand, name).default
                for name in ("prefetch", "wait", "wait_bw", "evict", "linear", "linear_grad_input")}
STREAMED_LINEAR_OPS = (torch.ops.stagehand.streamed_linear, torch.ops.stagehand.streamed_linear.default)
