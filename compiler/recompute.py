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

The recompute replays the forward's random numbers (the CPU and CUDA
generator states are kept and restored, as torch.utils.checkpoint does, and
recomputed variants compile with Inductor's `fallback_random` so both
variants draw from those generators in the same order): dropout inside a
block gets the same masks twice. Gradients of gradients are refused
(`once_differentiable`), not silently zero.
"""

from __future__ import annotations

from typing import Callable

import torch

# A unit runner: args -> outputs, compiled for the grad mode it is called in; args
# are the unit's inputs followed by the four tokens (fetch, block, next, prev);
# outputs end with the next-fetch token.
Runner = Callable[[tuple], tuple]
_TOKENS = 4


def run_again_after_oom(run: Callable[[], object], recover: Callable[[BaseException], bool]):
    """`run()`; when it runs out of device memory and `recover(error)` says the owner re-planned, it runs again
    (runtime/conductor/oom_recovery.py says when not); else the error goes on. A unit's forward (units.py) and a recomputed
    block's backward (below) start from inputs that are still whole, so running them again is exact."""
    while True:
        try:
            return run()
        except torch.OutOfMemoryError as error:
            if not recover(error):
                raise


class _RecomputeHooks:
    """What a recomputed block tells its owner: a recompute ran; the backward failed (drop held slots); the
    backward ran out of memory (`on_oom(error)`: True when the owner re-planned and it may run again)."""

    def __init__(self, on_recompute: Callable[[], None], on_error: Callable[[], None],
                 on_oom: Callable[[BaseException], bool] | None = None):
        self.on_recompute, self.on_error, self.on_oom = on_recompute, on_error, on_oom


class RecomputedBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Runner, hooks: _RecomputeHooks, *args):
        ctx.run, ctx.hooks = run, hooks
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        ctx.needs_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        # The recompute must draw the same random numbers (dropout masks) as this forward,
        # as torch.utils.checkpoint makes sure: keep the generators' states to replay them.
        ctx.cuda_devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        with torch.no_grad():
            outputs = tuple(run(args))
        input_storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        result = []
        for out in outputs:
            if isinstance(out, torch.Tensor) and (out.is_floating_point() or out.is_complex()):
                if out.untyped_storage().data_ptr() in input_storages:
                    out = out.clone()  # a Function's output that aliases its input could not be edited in place
            elif isinstance(out, torch.Tensor):
                ctx.mark_non_differentiable(out)  # the next-fetch token
            result.append(out)
        return tuple(result)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the recompute builds no graph of its gradient: say so
    def backward(ctx, *grad_outputs):
        # The recompute starts from the saved inputs: out of memory, it can run again once the owner re-planned.
        recover = ctx.hooks.on_oom or (lambda error: False)
        return run_again_after_oom(lambda: RecomputedBlock._backward(ctx, grad_outputs), recover)

    @staticmethod
    def _backward(ctx, grad_outputs):
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
        ctx.hooks.on_recompute()
        grads: list[torch.Tensor | None] = [None] * len(args)
        try:
            with torch.random.fork_rng(devices=ctx.cuda_devices):
                torch.set_rng_state(ctx.cpu_rng)
                for device, state in zip(ctx.cuda_devices, ctx.cuda_rng):
                    torch.cuda.set_rng_state(state, device)
                with torch.enable_grad():
                    outputs = tuple(ctx.run(tuple(args)))
            pairs = [
                (out, grad)
                for out, grad in zip(outputs[:-1], grad_outputs[:-1])
                if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
            ]
            if pairs and inputs_with_grad:
                found = torch.autograd.grad(
                    [o for o, _ in pairs], [args[i] for i in inputs_with_grad], [g for _, g in pairs],
                    allow_unused=True,
                )
                for i, g in zip(inputs_with_grad, found):
                    grads[i] = g
        except BaseException:
            ctx.hooks.on_error()  # a wait_bw inside took a hold its evict never dropped
            raise
        return (None, None, *grads)


def run_recomputed(run: Runner, args: tuple, on_recompute: Callable[[], None], on_error: Callable[[], None],
                   on_oom: Callable[[BaseException], bool] | None = None) -> tuple:
    """Run a block unit so that its backward recomputes it (see the module docstring)."""
    return RecomputedBlock.apply(run, _RecomputeHooks(on_recompute, on_error, on_oom), *args)
