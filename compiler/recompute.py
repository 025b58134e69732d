"""Block recompute: a block unit that saves its inputs, not its activations. Forward: the inference variant runs
under `no_grad`, saving only the unit's inputs (never a streamed weight). Backward: the training variant runs again
on them and its backward at once (`torch.autograd.grad`), under the same fetch of the block's weights; its prefetch
points at the block whose backward runs next. The forward's random numbers are replayed (generator states restored;
`fallback_random`). Gradients of gradients are refused."""

from __future__ import annotations

from typing import Callable

import torch

# A unit runner: (*inputs, fetch, block, next, prev tokens) -> (*outputs, next-fetch token), for the grad mode.
Runner = Callable[[tuple], tuple]
_TOKENS = 4


def run_again_after_oom(run: Callable[[], object], recover: Callable[[BaseException], bool]):
    """`run()`, again after running out of device memory while `recover(error)` says the owner re-planned (a
    unit's forward and a recompute's backward start from whole inputs: running them again is exact)."""
    while True:
        try:
            return run()
        except torch.OutOfMemoryError as error:
            if not recover(error):
                raise


class RecomputedBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Runner, on_recompute, on_error, on_oom, *args):
        ctx.run, ctx.on_recompute, ctx.on_error, ctx.on_oom = run, on_recompute, on_error, on_oom
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        ctx.needs_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))
        # The recompute must draw this forward's random numbers (dropout masks): keep the generators' states.
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
        recover = ctx.on_oom or (lambda error: False)
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
        ctx.on_recompute()
        grads: list[torch.Tensor | None] = [None] * len(args)
        try:
            with torch.random.fork_rng(devices=ctx.cuda_devices):
                torch.set_rng_state(ctx.cpu_rng)
                for device, state in zip(ctx.cuda_devices, ctx.cuda_rng):
                    torch.cuda.set_rng_state(state, device)
                with torch.enable_grad():
                    outputs = tuple(ctx.run(tuple(args)))
            pairs = [(out, grad) for out, grad in zip(outputs[:-1], grad_outputs[:-1])
                     if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None]
            if pairs and inputs_with_grad:
                found = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in inputs_with_grad],
                                            [g for _, g in pairs], allow_unused=True)
                for i, g in zip(inputs_with_grad, found):
                    grads[i] = g
        except BaseException:
            ctx.on_error()  # a wait_bw inside took a hold its evict never dropped
            raise
        return (None, None, None, None, *grads)


def run_recomputed(run: Runner, args: tuple, on_recompute: Callable[[], None], on_error: Callable[[], None],
                   on_oom: Callable[[BaseException], bool] | None = None) -> tuple:
    """Run a block unit so that its backward recomputes it (module docstring), telling its owner that a recompute
    ran, that the backward failed (drop held slots), or that it ran out of memory (`on_oom(error)`: True when the
    owner re-planned and it may run again)."""
    return RecomputedBlock.apply(run, on_recompute, on_error, on_oom, *args)
