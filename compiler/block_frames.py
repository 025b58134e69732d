"""`torch.compile(model)` on an offloaded model compiles each block on its own, one trace per block structure,
and runs the code around the blocks (embeddings, the loop, the head, the loss) eagerly.

`offload()` replaces the model's `forward` with one that notes the compile the call runs under (the eval-frame
callback of the user's `torch.compile`: its backend and options) and runs the model's own forward with Dynamo off,
and each block's `forward` with a `BlockFrame` that runs the block's own forward under that compile. Every block
of a structure shares that code object, and Dynamo guards on the structure, not on the module, so the first
block's graph serves the rest. Outside a compiled call the blocks run as they were. The code around the blocks
runs eagerly because it measures no slower and lets a library take its eager paths: transformers builds no
causal mask when it is not traced (flash attention, `is_causal`), where a traced mask would reach every block's
graph as an input. A block the model calls under torch.utils.checkpoint (which turns Dynamo off, and runs the
block again in backward) still runs under the call's compile. Where a caller compiles only a part of the model
around the blocks, each block called under that compile is a frame of its own the same way. `compile_blocks`
sets the frames' compiled callables instead."""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback, set_eval_frame
from torch.utils._pytree import tree_map_only

from torch_stagehand.compiler import residual_hints

log = logging.getLogger("torch_stagehand.compiler")
_frames: "weakref.WeakKeyDictionary[Any, BlockFrames]" = weakref.WeakKeyDictionary()


class RegionalCompileWarning(UserWarning):
    """A compiled offloaded model whose blocks can not share one Dynamo graph (e.g. an HF model with a KV cache)."""


def model_checkpoints_blocks(rt) -> bool:
    """Did the model's own activation checkpointing move into the block units (`BlockUnit.recomputes_block`)?"""
    frames = _frames.get(rt)
    return frames is not None and frames.checkpoints_blocks


def install(rt, model: nn.Module) -> None:
    """Make each of `rt`'s blocks in `model` its own frame (offload)."""
    _frames[rt] = BlockFrames(rt, model)


def frames_of(rt) -> "BlockFrames":
    return _frames[rt]


class BlockFrames:
    """The frames of one runtime's blocks: installed by `offload()`, removed when the runtime closes."""

    def __init__(self, rt, model: nn.Module):
        self._rt, self.model = weakref.ref(rt), model  # weak: `_frames` is keyed by the runtime
        self.frames = [BlockFrame(self, model.get_submodule(fqn), fqn, i) for i, fqn in enumerate(rt.blocks)]
        # Modules whose `gradient_checkpointing` flag makes the model checkpoint its blocks: the blocks themselves
        # (transformers) and the modules above them (diffusers checks the flag in the loop over its blocks).
        above = {".".join(fqn.split(".")[:i]) for fqn in rt.blocks for i in range(fqn.count(".") + 1)}
        self._flag_holders = [m for m in [model.get_submodule(n) for n in sorted(above)] +
                              [f.block for f in self.frames] if hasattr(m, "gradient_checkpointing")]
        self._prepared = False
        self._warned_kv_cache = False
        self.checkpoints_blocks = False  # the last compiled call found the model's checkpointing on
        # The compile (its eval-frame callback: False is Dynamo's run-only mode) of the model call now running or
        # last run (a checkpoint's recompute in backward runs under it too); None when the call ran eagerly.
        self.model_callback = None
        self.kv_cache_in_call = False  # the model call now running fills a KV cache (a compiled block: traced again)
        # What offload replaces, put back by `remove` where it is still ours: an instance's own forward
        # (accelerate's hooks set one) or none (the class's).
        self._replaced = [(m, vars(m).get("forward")) for m in [model, *(f.block for f in self.frames)]]
        self._model_forward = torch._dynamo.disable(self._model_call(model.forward), recursive=False)
        model.forward = self._model_forward
        for frame in self.frames:
            frame.block.forward = torch._dynamo.disable(frame, recursive=False)
        rt.on_close(self.remove)

    @property
    def rt(self):
        return self._rt()

    def remove(self) -> None:
        _frames.pop(self.rt, None)
        ours = [self._model_forward, *(f.block.forward for f in self.frames
                                        if getattr(f.block.forward, "_torchdynamo_orig_callable", None) is f)]
        for module, prior in self._replaced:
            if any(vars(module).get("forward") is f for f in ours):
                if prior is None:
                    del module.forward
                else:
                    module.forward = prior

    def _model_call(self, forward: Callable) -> Callable:
        """The model's forward, noting the compile it is called under (this wrapper is disabled non-recursively:
        the caller's callback is still set) and run with Dynamo off (the blocks then run under that compile)."""
        eager = torch._dynamo.disable(forward)

        takes_use_cache = _takes_keyword(forward, "use_cache")

        @functools.wraps(forward)  # the signature stays the model's (HF Trainer reads it for its columns)
        def call(*args, **kwargs):
            self.model_callback = get_eval_frame_callback()
            compiled = self.model_callback is not None or self.frames[0].compiled is not None
            kwargs = self._call_began(kwargs, takes_use_cache, compiled)
            if not compiled:
                return eager(*args, **kwargs)  # an eager call: the model as it was, its own checkpointing too
            # The blocks compile: the model's own activation checkpointing is switched off for the call and done by
            # the block units instead, so that no block runs its forward three times (flags put back after it).
            on = [m for m in self._flag_holders if m.gradient_checkpointing is True]
            self.checkpoints_blocks = bool(on)
            for m in on:
                m.gradient_checkpointing = False
            try:
                return eager(*args, **kwargs)
            finally:
                for m in on:
                    m.gradient_checkpointing = True

        return call

    # Disabled: the model's call is disabled non-recursively, so what it calls would be traced by the compile.
    @torch._dynamo.disable
    def _call_began(self, kwargs: dict, takes_use_cache: bool, compiled: bool) -> dict:
        """The model's call began: the step's clock starts (before its first block traces and compiles). Returns
        its keyword arguments, `use_cache=False` added to a compiled training call (it reads no KV cache, and
        filling one by layer index would trace every block again), and notes whether the call fills a cache (a
        block compiled under it warns)."""
        rt = self.rt
        if rt is not None:
            rt.model_call_began()
        training = torch.is_grad_enabled() and self.model.training
        if compiled and takes_use_cache and "use_cache" not in kwargs and training and self._kv_cache_configured():
            kwargs = {**kwargs, "use_cache": False}
        asked = kwargs.get("use_cache") if takes_use_cache else False
        self.kv_cache_in_call = self._kv_cache_configured() if asked is None else bool(asked)
        return kwargs

    def compile_each(self, **compile_kwargs) -> None:
        """`compile_blocks`: each block's forward compiled on its own, with these `torch.compile` arguments."""
        for frame in self.frames:
            frame.compiled = torch.compile(frame.forward, **compile_kwargs)

    def before_compiled_call(self) -> None:
        """Under a compile: the KV-cache warning (once) and, the first time, the residual-stream hints."""
        if self.kv_cache_in_call and not self._warned_kv_cache:
            self._warned_kv_cache = True
            self._warn_use_cache()
        if not self._prepared:
            self._prepared = True
            self._load_hints()

    def move_checkpointing(self) -> None:
        """A compile of a part of the model around the blocks (the model's own call not compiled): its
        checkpointing flags switched off for good and done by the block units."""
        if any(m.gradient_checkpointing is True for m in self._flag_holders):
            for m in self._flag_holders:
                m.gradient_checkpointing = False
            self.checkpoints_blocks = True
            log.info("stagehand: the model's activation checkpointing now runs inside each block unit")

    def _kv_cache_configured(self) -> bool:
        config = getattr(self.model, "config", None)
        return bool(getattr(config, "use_cache", False)) and not getattr(config, "is_encoder_decoder", False)

    def _warn_use_cache(self) -> None:
        warnings.warn(
            f"stagehand: {type(self.model).__name__}'s compiled call fills a KV cache (use_cache=True): its layers "
            "update it by their layer index, which Dynamo guards on, so every block is traced again (and past "
            "torch._dynamo.config.recompile_limit runs eagerly); pass use_cache=False where the call needs no cache "
            "(a training call gets it from stagehand)", RegionalCompileWarning, stacklevel=4)

    def _load_hints(self) -> None:
        """The residual-stream arguments an earlier run found (residual_hints.py): given grad on the first block."""
        from torch_stagehand.compiler.variants import variant_cache

        bundle = variant_cache(self.rt).bundle
        hints = residual_hints.load(bundle.path) if bundle is not None else {}
        for frame in self.frames:
            residual = hints.get(residual_hints.block_list(frame.fqn))
            if residual:
                frame.needing_grad = functools.partial(
                    residual_hints.give_grad, residual_hints.positional_names(frame.forward), residual)


def _takes_keyword(function: Callable, name: str) -> bool:
    """Whether `function` accepts the keyword argument `name` (by name or through its **kwargs)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class BlockFrame:
    """What one offloaded block's `forward` is: in a compiled call, the block's arguments made the same for every
    block of its structure, then the block's own forward as a frame of its own under that compile (or its
    `compile_blocks` callable)."""

    def __init__(self, frames: BlockFrames, block: nn.Module, fqn: str, index: int):
        self.frames, self.block, self.fqn, self.index = frames, block, fqn, index
        self.forward: Callable = block.forward  # the block's own (bound, with its class's decorators)
        self.compiled: Callable | None = None
        self.needing_grad: Callable | None = None

    def __call__(self, *args, **kwargs):
        active = get_eval_frame_callback()  # None: Dynamo off here; False: its run-only mode
        callback = active if active is not None else self.frames.model_callback
        if self.compiled is None and callback is None:
            return self.forward(*args, **kwargs)  # no compile: the block as it was
        args, kwargs = self._arguments(args, kwargs)
        if self.compiled is not None:
            return self.compiled(*args, **kwargs)
        if active is not None:
            self.frames.move_checkpointing()
            return self.forward(*args, **kwargs)
        # The model's call ran under a compile (BlockFrames.model_callback), its own code with Dynamo off: the block
        # runs under that compile. Called in backward, it is a checkpoint's recompute.
        if torch._C._current_graph_task_id() != -1:
            self.frames.rt.record_recompute(self.index)
        prior = set_eval_frame(callback)
        try:
            return self.forward(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    @torch._dynamo.disable
    def _arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Every tensor argument with the canonical stride in its size-1 dimensions (such a stride addresses
        nothing, but Dynamo guards on it), and in training, where the block has a parameter that trains, its
        residual-stream arguments needing grad (residual_hints.give_grad; a first block would otherwise be traced
        apart). Disabled: a frame of its own here would be compiled too."""
        self.frames.before_compiled_call()
        args, kwargs = tree_map_only(torch.Tensor, unit_strides, (args, kwargs))
        if self.needing_grad is not None and torch.is_grad_enabled():
            args, kwargs = self.needing_grad(args, kwargs, lambda: any(p.requires_grad for p in self.block.parameters()))
        return args, kwargs


def unit_strides(t: torch.Tensor) -> torch.Tensor:
    """`t` as a view whose size-1 dimensions have the stride a contiguous tensor would give them (the next
    dimension's size times its stride; 1 for the last), its other strides unchanged; `t` itself if they do."""
    if t.dim() == 0 or 1 not in t.shape:
        return t
    sizes = t.shape
    for d in reversed(range(t.dim())):
        want = 1 if d == t.dim() - 1 else sizes[d + 1] * t.stride()[d + 1]
        if sizes[d] == 1 and t.stride()[d] != want:
            t = t.squeeze(d).unsqueeze(d)  # unsqueeze gives the new dimension exactly `want`
    return t
