"""Block recompute: a block unit that saves its inputs, not its activations.

Used for blocks the model itself checkpoints (their checkpoint regions were
inlined by `passes/inline_checkpoints`) and for every block when the backend
option `recompute="blocks"` asks for it.

Forward: the block's compiled *inference* variant runs under `no_grad`
(wait -> prefetch(next) -> linears -> evict), and only the unit's inputs are
saved: the hidden states and the resident parameters (LoRA adapters, norms),
never a streamed weight (the slot is not an input of the unit).

Backward: the block's compiled *training* variant runs again on the saved
inputs with grad enabled, and its backward graph runs at once through
`torch.autograd.grad`. The two share one fetch of the block's weights: the
recompute's `wait` brings the block in (usually already prefetched by the
block after it), its evict leaves the bytes in the slot, and the backward
graph's `wait_bw` finds them there. The recompute's own `prefetch` is pointed
at the block whose backward runs next (the unit's `prev` token takes the
`next` position), so the H2D copy of that block overlaps this one's work.

Inputs that need no grad stay attached as they are; the ones that need grad
are detached so the grads come back here and are returned to the outer
autograd graph (which accumulates them into the parameters' `.grad`).
"""

from __future__ import annotations

from typing import Callable

import torch

# A unit runner: args -> outputs, compiled for the grad mode it is called in; args
# are the unit's inputs followed by the four tokens (fetch, block, next, prev);
# outputs end with the next-fetch token.
Runner = Callable[[tuple], tuple]
_TOKENS = 4


class RecomputedBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Runner, on_recompute: Callable[[], None], *args):
        ctx.run, ctx.on_recompute = run, on_recompute
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        ctx.needs_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        with torch.no_grad():
            outputs = tuple(run(args))
        for out in outputs:
            if isinstance(out, torch.Tensor) and not out.is_floating_point():
                ctx.mark_non_differentiable(out)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        saved = dict(zip(ctx.tensor_positions, ctx.saved_tensors))
        args = [saved[i] if i in saved else ctx.others[i] for i in range(len(saved) + len(ctx.others))]
        inputs_with_grad = []
        for i, needs in enumerate(ctx.needs_grad[: len(args) - _TOKENS]):
            if needs:
                args[i] = args[i].detach().requires_grad_(True)
                inputs_with_grad.append(i)
        fetch_tok, block_tok, _next_tok, prev_tok = args[-_TOKENS:]
        # In backward the block that runs next is the previous one: prefetch it.
        args[-_TOKENS:] = [fetch_tok, block_tok, prev_tok, prev_tok]
        ctx.on_recompute()
        with torch.enable_grad():
            outputs = tuple(ctx.run(tuple(args)))
        pairs = [
            (out, grad)
            for out, grad in zip(outputs[:-1], grad_outputs[:-1])
            if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
        ]
        grads: list[torch.Tensor | None] = [None] * len(args)
        if pairs and inputs_with_grad:
            found = torch.autograd.grad(
                [o for o, _ in pairs], [args[i] for i in inputs_with_grad], [g for _, g in pairs], allow_unused=True
            )
            for i, g in zip(inputs_with_grad, found):
                grads[i] = g
        return (None, None, *grads)


def run_recomputed(run: Runner, args: tuple, on_recompute: Callable[[], None]) -> tuple:
    """Run a block unit so that its backward recomputes it (see the module docstring)."""
    return RecomputedBlock.apply(run, on_recompute, *args)
