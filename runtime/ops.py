"""The stagehand custom ops: what the rewritten graphs are made of.

Two families:

* `streamed_linear(x, bias, block_tok, position, out_features)` is what a
  streamed module's forward calls,
  so it is what Dynamo captures. Run eagerly (no compile, another backend, a
  graph-break fallback) it fetches the layer's block on demand and computes:
  slow but correct. The stagehand backend rewrites it away.

* The scheduled ops the backend emits, ordered by data through tokens so any
  inner compiler may reorder freely:

      fetch = prefetch(block_tok, after=[...])      # H2D copy on the side stream
      slot  = wait(fetch, block_tok, nbytes, prec)   # compute stream waits on it
      y     = linear(x, slot, bias, block_tok, prev_tok, layout)
      free  = evict(block_tok, slot, readers=[y, ...], prec)

  `linear` saves no weight for backward: its backward formula asks for the
  block again with `wait_bw(block_tok, dy, ...)` (and prefetches the block
  that runs backward next), which the backward schedule pass dedupes per block
  and closes with an `evict`. Both live in the joint graph, so the partitioned
  backward graph (which compiled autograd copies) contains them.

Block tokens are 0-dim int64 CPU tensors (see registry.py). The ops that only
order things (prefetch, evict) are registered as side-effectful so dead-code
elimination keeps them even where their token output is unused.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime import registry
from torch_stagehand.runtime.precision import LayerLayout

# ---- the math on a slot: the layout's code names the precision that computes it ------------


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


# ---- eager entry point: what Dynamo sees ----------------------------------------------


@custom_op("stagehand::streamed_linear", mutates_args=())
def streamed_linear(x: torch.Tensor, bias: torch.Tensor | None, block_tok: torch.Tensor, position: int,
                    out_features: int, anchor: torch.Tensor | None = None) -> torch.Tensor:
    """The `position`-th streamed Linear of the block `block_tok` names. `anchor`: the block's grad anchor
    (train/grads.py); it requires grad when the layer's weight may train. Nothing here names one layer of one
    block as a constant, so every block of a structure captures the same graph."""
    rt, index = _layer_of(block_tok, position)
    return rt.eager_linear(index, x, bias)


@streamed_linear.register_fake
def _(x, bias, block_tok, position, out_features, anchor=None):
    return _linear_out(x, out_features)


def _layer_of(block_tok: torch.Tensor, position: int):
    """(runtime, index in runtime.layers) of a block's `position`-th streamed layer."""
    rt, block = registry.decode(block_tok)
    if rt is None:
        raise RuntimeError("stagehand: a streamed linear was called with the no-block token")
    return rt, rt.layer_at(block, position)


@custom_op("stagehand::streamed_linear_grad_input", mutates_args=())
def streamed_linear_grad_input(dy: torch.Tensor, block_tok: torch.Tensor, position: int,
                               in_features: int) -> torch.Tensor:
    rt, index = _layer_of(block_tok, position)
    return rt.eager_grad_input(index, dy)


@streamed_linear_grad_input.register_fake
def _(dy, block_tok, position, in_features):
    return dy.new_empty(*dy.shape[:-1], in_features)


@custom_op("stagehand::streamed_linear_grad_weight", mutates_args=())
def streamed_linear_grad_weight(dy: torch.Tensor, x: torch.Tensor, block_tok: torch.Tensor, position: int) -> torch.Tensor:
    """The layer's weight gradient, computed and sent to its host buffer (train/grads.py); returns a token.
    Nothing when the layer does not train (decided at run time: a traced call sees no token value)."""
    rt, index = _layer_of(block_tok, position)
    if rt.grads.trainable(index):
        rt.grads.grad_weight(index, dy, x)
    return registry_sentinel()


@streamed_linear_grad_weight.register_fake
def _(dy, x, block_tok, position):
    return torch.empty((), dtype=torch.int64)


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


# ---- scheduled ops ------------------------------------------------------------------


@custom_op("stagehand::prefetch", mutates_args=())
def prefetch(block_tok: torch.Tensor, after: list[torch.Tensor]) -> torch.Tensor:
    rt, block = registry.decode(block_tok)
    if rt is None:
        return registry_sentinel()
    return rt.op_prefetch(block)


@prefetch.register_fake
def _(block_tok, after):
    return torch.empty((), dtype=torch.int64)


@custom_op("stagehand::wait", mutates_args=())
def wait(fetch_tok: torch.Tensor, block_tok: torch.Tensor, nbytes: int, precision: int, device: torch.device) -> torch.Tensor:
    rt, block = registry.decode(block_tok)
    return rt.op_wait(block, precision, nbytes, backward=False)


@wait.register_fake
def _(fetch_tok, block_tok, nbytes, precision, device):
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


@custom_op("stagehand::wait_bw", mutates_args=())
def wait_bw(block_tok: torch.Tensor, anchor: torch.Tensor, nbytes: int, precision: int, device: torch.device) -> torch.Tensor:
    rt, block = registry.decode(block_tok)
    return rt.op_wait(block, precision, nbytes, backward=True)


@wait_bw.register_fake
def _(block_tok, anchor, nbytes, precision, device):
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


@custom_op("stagehand::evict", mutates_args=())
def evict(block_tok: torch.Tensor, slot: torch.Tensor, readers: list[torch.Tensor], precision: int) -> torch.Tensor:
    rt, block = registry.decode(block_tok)
    return rt.op_release(block, precision)


@evict.register_fake
def _(block_tok, slot, readers, precision):
    return torch.empty((), dtype=torch.int64)


@custom_op("stagehand::linear", mutates_args=())
def linear(
    x: torch.Tensor,
    slot: torch.Tensor,
    bias: torch.Tensor | None,
    block_tok: torch.Tensor,
    prev_tok: torch.Tensor,
    layout: list[int],
) -> torch.Tensor:
    return linear_from_slot(x, slot, bias, layout)


@linear.register_fake
def _(x, slot, bias, block_tok, prev_tok, layout):
    return _linear_out(x, LayerLayout.from_ints(layout).out_features)


@custom_op("stagehand::linear_grad_input", mutates_args=())
def linear_grad_input(dy: torch.Tensor, slot: torch.Tensor, layout: list[int]) -> torch.Tensor:
    return grad_input_from_slot(dy, slot, layout)


@linear_grad_input.register_fake
def _(dy, slot, layout):
    return dy.new_empty(*dy.shape[:-1], LayerLayout.from_ints(layout).in_features)


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


@custom_op("stagehand::grad_weight", mutates_args=())
def grad_weight(dy: torch.Tensor, x: torch.Tensor, block_tok: torch.Tensor, position: int) -> torch.Tensor:
    """In a compiled block's backward: the weight gradient of the block's `position`-th streamed layer,
    computed and sent to its host buffer (train/grads.py). Returns a token nothing reads (kept: side effect)."""
    rt, block = registry.decode(block_tok)
    rt.grads.grad_weight_at(block, position, dy, x)
    return registry_sentinel()


@grad_weight.register_fake
def _(dy, x, block_tok, position):
    return torch.empty((), dtype=torch.int64)


class GradTap(torch.autograd.Function):
    """`y = tap(linear(x, slot, ...), x, anchor)`: the identity forward; in backward, the weight gradient.

    rewrite_linear puts it after each streamed Linear whose weight trains, so the grad-weight GEMM runs
    in the block's compiled backward beside the grad-input (both read `dy`). It saves the Linear's input
    (an activation), never the slot. `anchor` (the block's grad anchor) makes autograd run this backward
    even when nothing upstream requires grad; its own gradient is None."""

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


_SENTINEL: list[torch.Tensor] = []


def registry_sentinel() -> torch.Tensor:
    """The token a no-op prefetch returns (allocated once)."""
    if not _SENTINEL:
        _SENTINEL.append(torch.tensor(registry.NO_BLOCK, dtype=torch.int64))
    return _SENTINEL[0]


# Keep ordering-only ops alive through FX/AOT dead-code elimination and Inductor's.
for _op in (torch.ops.stagehand.prefetch.default, torch.ops.stagehand.evict.default,
            torch.ops.stagehand.grad_weight.default, torch.ops.stagehand.streamed_linear_grad_weight.default):
    torch.fx.node.has_side_effect(_op)

SCHEDULE_OPS = {
    "prefetch": torch.ops.stagehand.prefetch.default,
    "wait": torch.ops.stagehand.wait.default,
    "wait_bw": torch.ops.stagehand.wait_bw.default,
    "evict": torch.ops.stagehand.evict.default,
    "linear": torch.ops.stagehand.linear.default,
    "linear_grad_input": torch.ops.stagehand.linear_grad_input.default,
}
STREAMED_LINEAR_OPS = (torch.ops.stagehand.streamed_linear, torch.ops.stagehand.streamed_linear.default)
