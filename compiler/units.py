"""Units: the callables the outer graph runs, one per segment. A `GlueUnit` compiles its segment as it is. A
`BlockUnit` runs, per call, the variant of its template for the block's current layout and precision, keyed
(structure, input signature, grad mode, inner compiler, rng replay) in the runtime's `VariantCache`: identical blocks
share one variant, a precision switch re-links them. Variants compile on first use, shape-generic where Dynamo made
dimensions dynamic (symbolic.py)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from torch_stagehand import kernels
from torch_stagehand.compiler import block_frames, residual_hints
from torch_stagehand.compiler.context import CompileContext, PassLog, VariantContext
from torch_stagehand.compiler.graph_nodes import draws_random, example_value, is_streamed_read, streamed_arg
from torch_stagehand.compiler.inner import compile_unit
from torch_stagehand.compiler.recompute import run_again_after_oom, run_recomputed
from torch_stagehand.compiler.startup import compile_cache
from torch_stagehand.compiler.startup.ahead import AheadJob
from torch_stagehand.compiler.startup.ahead_wire import input_specs, pickle_graph
from torch_stagehand.compiler.symbolic import SymbolicInputs, input_key
from torch_stagehand.runtime import registry

if TYPE_CHECKING:
    from torch_stagehand.compiler.passes.assign_segments import Segment

log = logging.getLogger("torch_stagehand.compiler")
_SHAPE_VARIANTS_WARNING = 8  # input signatures per structure beyond which shapes are changing per call


def structure_key(gm: fx.GraphModule) -> str:
    """A hash of what the graph computes, blind to node names."""
    index: dict[fx.Node, str] = {}
    parts = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = f"%{i}"
        target = node.target
        if node.op == "get_attr":
            target = f"{target}@{id(getattr(gm, target, None))}"  # a constant shares only with itself
        elif node.op == "placeholder":
            target = ""
        elif not isinstance(target, str):
            target = getattr(target, "__module__", "") + "." + getattr(target, "__qualname__", str(target))
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        parts.append((node.op, target, repr(args)))
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def _tuple_output(gm: fx.GraphModule) -> bool:
    """Make the graph return a tuple (AOTAutograd wants one); say whether it returned one already."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return True
    output.args = ((output.args[0],),)
    gm.recompile()
    return False


def _code_settled(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with its code generated now: a lazy GraphModule (Dynamo's) generates it at first use, and the compile
    caches key on the module's attributes in their order, which would then depend on where that use falls."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    _LazyGraphModule.force_recompile(gm)
    return gm


def rt_trainable(rt, block: int) -> tuple[int, ...]:
    """The positions of `block` whose streamed weights train (get a grad-weight GEMM); none without grad."""
    return rt.trainable_positions(block) if torch.is_grad_enabled() else ()


def _run_unit(rt, where: Callable[[], str], run: Callable[[], Any]):
    """`run()`, again after the runtime recovered from out of memory; `where()` names the unit (made only then)."""
    return run_again_after_oom(run, lambda error: rt.recover_from_oom(where(), error))


class _Unit(nn.Module):
    def __init__(self, template: fx.GraphModule, ctx: CompileContext, segment: "Segment", name: str):
        super().__init__()
        self.template = template
        self.ctx = ctx
        self.segment = segment
        self.unit_name = name
        self.last_key = None  # the variant the last call ran (explain reads it)
        self.symbolic = SymbolicInputs.of(template)  # dynamic dimensions: shape-generic variants (symbolic.py)

    def signature(self, args: tuple) -> tuple:
        """A variant key's input part (symbolic.input_key): exact, or what a shape-generic unit's guards skip."""
        exact = self.symbolic is None
        key = tuple(input_key(a, exact_sizes=exact, grad=torch.is_grad_enabled()) for a in args)
        return key if exact else ("symbolic", key)

    def _compile(self, key: Any, gm: fx.GraphModule, args: tuple, label: str, block_variant: bool,
                 pass_log: PassLog, replay_rng: bool = False):
        """Compile `gm` for `args` into the variant cache; `pass_log` holds the passes that made it."""
        rt, cache = self.ctx.runtime, self.ctx.variants
        graphs: dict[str, str] = {}

        def on_graph(kind: str, graph_module: fx.GraphModule) -> None:
            graphs[kind] = graph_module.print_readable(print_output=False, include_stride=False, include_device=True)
        if not torch.is_grad_enabled():
            # Grad flags change nothing an inference variant compiles; AOTAutograd's cache key must not see them.
            args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        faked = None if self.symbolic is None else self.symbolic.fake(args)
        why = cache.why_new(key)  # before it joins the cache
        # Wait for a worker compiling this ahead (doing the W8A16 tuning put off meanwhile); a queued job is dropped.
        ahead = cache.ahead.take(key, kernels.tune_deferred) if cache.ahead is not None else None
        cache.before_compile()
        start = time.perf_counter()
        with compile_cache.track() as outcome:
            compiled = compile_unit(gm, list(args), self.ctx.options.inner, on_graph, self.ctx.joint_passes,
                                    pass_log, replay_rng=replay_rng, faked=faked)
        seconds = time.perf_counter() - start
        rt.record_compile(seconds, block_variant, outcome.loaded)
        cache.add(key, compiled, {
            "label": label, "graphs": graphs, "seconds": seconds, "shape_generic": faked is not None,
            "cache": outcome.state, "why": why, "ahead": ahead.describe() if ahead is not None else "",
            "scheduled": gm.print_readable(print_output=False, include_stride=False, include_device=True),
            "passes": [dataclasses.asdict(r) for r in pass_log.passes_ran],
        }, guard=None if faked is None else faked.guard())
        cache.after_compile(outcome.loaded, by_worker=ahead is not None and not ahead.error)
        log.info("stagehand: %s %s (%s%s) in %.2fs (cache: %s; %s%s)", "loaded" if outcome.loaded else "compiled",
                 label, self.ctx.options.inner, "" if faked is None else ", all sizes of the dynamic dimensions",
                 seconds, outcome.state, why, "" if ahead is None else "; " + ahead.describe())
        if faked is None:
            cache.warn_on_a_second_shape(key[0], args, label, block_variant)
        per_structure = cache.count_structure(key[0])
        if per_structure == _SHAPE_VARIANTS_WARNING + 1:
            log.warning("stagehand: %s compiled for %d different input shapes; pad inputs to a few bucket sizes "
                        "to stop recompiling", label, per_structure)
        return compiled


class GlueUnit(_Unit):
    """A segment with no streamed weights: compiled as is."""

    def __init__(self, template, ctx, segment, name):
        super().__init__(template, ctx, segment, name)
        self.returns_tuple = _tuple_output(_code_settled(template))
        self._key = ("glue", structure_key(template))

    def forward(self, *args):
        key = self.last_key = (self._key, self.signature(args), torch.is_grad_enabled(), self.ctx.options.inner)
        compiled = self.ctx.variants.get(key, args) or self._compile(key, self.template, args, self.unit_name, False,
                                                                     PassLog())
        out = _run_unit(self.ctx.runtime, lambda: f"glue unit {self.unit_name}", lambda: compiled(*args))
        if self.ctx.variants.first_run(key):
            self.ctx.runtime.record_first_run()
        return out if self.returns_tuple else out[0]


class BlockUnit(_Unit):
    """A block segment, run for the block its caller's `block_tok` names (Dynamo reuses a graph for every block of
    its structure): `unit(*inputs, fetch_tok, block_tok, next_tok, prev_tok)` -> `(*outputs, next_fetch_tok)`."""

    def __init__(self, template, ctx, segment, name):
        super().__init__(template, ctx, segment, name)
        self.block = segment.block  # the block Dynamo traced (its first user)
        self.variants_ran: dict = {}  # every variant key a call ran -> its precision (explain lists them)
        self.returns_tuple = _tuple_output(template)
        streamed = [n for n in template.graph.nodes if is_streamed_read(n)]
        self._positions = tuple(streamed_arg(n, "position") for n in streamed)
        # The inputs that are block tokens (each call's own block): keyed as "a token", not by value.
        placeholders = [n for n in template.graph.nodes if n.op == "placeholder"]
        self._token_inputs = frozenset(placeholders.index(t) for t in (streamed_arg(n, "block_tok") for n in streamed)
                                       if t in placeholders)
        self._layouts: dict[tuple[int, str], int] = {}  # (block, precision) -> its layout's id
        self._layout_ids: dict[tuple, int] = {}
        self._variants: dict[tuple, tuple[fx.GraphModule, str, VariantContext]] = {}
        self._random: dict[str, bool] = {}  # structure key -> may the variant draw random numbers?
        self._residual: frozenset[int] | None = None  # _residual_inputs, worked out once
        self._training_of: dict[tuple, tuple] = {}  # inference variant handed to a worker -> its training variant

    def signature(self, args: tuple) -> tuple:
        if not self._token_inputs:
            return super().signature(args)
        return super().signature(tuple("block_tok" if i in self._token_inputs else a for i, a in enumerate(args)))

    def _layout_key(self, block: int, precision: str) -> int:
        """Where the block's layers sit in its device bytes, as a small id shared by blocks that agree."""
        key = (block, precision)
        if key not in self._layouts:
            rt = self.ctx.runtime
            layout = (precision, rt.block_nbytes(block, precision), *(
                tuple(rt.layer_layout(rt.layer_at(block, p), precision)) for p in self._positions))
            self._layouts[key] = self._layout_ids.setdefault(layout, len(self._layout_ids))
        return self._layouts[key]

    def variant_graph(self, precision: str, trainable: tuple[int, ...] = (),
                      block: int | None = None) -> tuple[fx.GraphModule, str, VariantContext]:
        """(variant graph, structure key, pass log) for `precision`, the layers that train and the block's layout."""
        block = self.block if block is None else block
        key = (precision, trainable, self._layout_key(block, precision))
        if key not in self._variants:
            vctx = VariantContext(self.ctx, block, precision, trainable)
            gm = _code_settled(vctx.run(self.ctx.variant_passes, copy.deepcopy(self.template)))
            skey = structure_key(gm)
            self._variants[key] = (gm, skey, vctx)
            self._random[skey] = draws_random(gm)
        return self._variants[key]

    def _residual_inputs(self) -> frozenset[int]:
        """The inputs that carry the residual stream: floating tensors shaped like one of the block's outputs."""
        if self._residual is None:
            output = next(n for n in self.template.graph.nodes if n.op == "output")
            values: list = []
            fx.node.map_arg(output.args, lambda n: values.append(example_value(n)))
            shape = lambda v: tuple(str(d) for d in v.shape)  # noqa: E731 - a dynamic size as its symbol
            shapes = {shape(v) for v in values if isinstance(v, torch.Tensor)}
            inputs = [example_value(n) for n in self.template.graph.nodes if n.op == "placeholder"]
            self._residual = frozenset(i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)
                                       and v.is_floating_point() and shape(v) in shapes)
        return self._residual

    def _compiling_ahead(self, key: tuple) -> bool:
        """Is a worker on `key` and its training variant not loaded yet? Then a forward runs its graph eagerly."""
        cache, training = self.ctx.variants, self._training_of.get(key)
        future = None if cache.ahead is None else cache.ahead.futures.get(key)
        return future is not None and not future.done() and training is not None and training not in cache.info

    def _compile_ahead(self, args: tuple, block: int, precision: str, recomputes: bool, label: str) -> bool:
        """From a recomputed block's forward (grad off): hand the training variant its recompute will run, then this
        inference variant, to the ahead-compile workers. True when the training variant went (run eagerly now)."""
        ahead = self.ctx.variants.ahead
        if ahead is None or self.symbolic is not None:
            return False
        cacheable, keys = None, []
        for grad in (True, False):  # the one the step waits for first, and handed over before the other is built
            try:
                cacheable = cacheable or compile_cache.cacheable_functions()  # hashes source files: once for both
                with torch.set_grad_enabled(grad):
                    gm, skey, vctx = self.variant_graph(precision, rt_trainable(self.ctx.runtime, block), block)
                    replay_rng = recomputes and self._random[skey]
                    key = (skey, self.signature(args[:-4]), grad, self.ctx.options.inner, replay_rng)
                    # Inside the recompute's Function the inputs keep their grad flags: the recompute's own.
                    inputs = args if grad else tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
                    job = AheadJob(key, f"block variant {skey} ({precision}, grad {'on' if grad else 'off'})",
                                   pickle_graph(gm), gm.code, input_specs(inputs), grad, replay_rng,
                                   self.ctx.joint_passes, cacheable)
            except Exception as e:  # noqa: BLE001 - only a speed-up: the forward compiles the variant itself
                ahead.refused.append(f"{label}: {type(e).__name__}: {e}")
                log.warning("stagehand: %s: not compiled ahead (%s: %s); compiling it here", label, type(e).__name__,
                            e)
                return False
            preload = self._preload(job.key, gm, inputs, self._label(skey, precision, block), vctx, replay_rng, grad)
            if not (ahead.submit(job, later=not grad, preload=preload) or job.key in ahead.futures):
                return False
            keys.append(job.key)
        self._training_of[keys[1]] = keys[0]
        return True

    def _label(self, skey: str, precision: str, block: int) -> str:  # a variant's name in logs and explain
        return f"block variant {skey} ({precision}, first used by {self.ctx.runtime.blocks[block]})"

    def _preload(self, key, gm, inputs, label, vctx, replay_rng, grad) -> Callable[[], None]:
        def preload() -> None:
            if key not in self.ctx.variants.info:
                with torch.set_grad_enabled(grad):
                    self._compile(key, gm, inputs, label, True, PassLog(vctx.passes_ran), replay_rng)

        return preload

    def recomputes_block(self, block: int) -> bool:
        """Does `block` recompute in backward? `recompute="blocks"`, else the VRAM plan, else the model's checkpoint."""
        if self.ctx.options.recompute == "blocks":
            return True
        planned = self.ctx.runtime.planned_recompute(block)
        if planned is not None:
            return planned
        return (self.segment.recompute or self.ctx.options.recompute == "model"
                or block_frames.model_checkpoints_blocks(self.ctx.runtime))

    def forward(self, *args):
        block = registry.decode(args[-3])[1]
        return _run_unit(self.ctx.runtime, lambda: f"the forward of block {block} ({self.ctx.runtime.blocks[block]})",
                         lambda: self._forward(args, block))

    def _forward(self, args: tuple, block: int):
        rt = self.ctx.runtime
        precision = rt.precision[block]
        recomputes = self.recomputes_block(block)
        if torch.is_grad_enabled():
            args = self._residual_stream_needing_grad(args)
        if recomputes and torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                                          for a in args):
            # The recompute runs in the precision this forward ran in, whatever the map is by then.
            return run_recomputed(lambda a: self._run_variant(a, block, precision, True, backward_follows=True), args,
                                  lambda: rt.record_recompute(block), rt.abort_held_blocks,
                                  lambda error: rt.recover_from_oom(
                                      f"the recomputed backward of block {block} ({rt.blocks[block]})", error,
                                      trainable_backward=bool(rt.trainable_positions(block))))
        spill = rt.spill_hooks(block) if torch.is_grad_enabled() else None
        if spill is not None:  # the plan sends this block's saved activations to host and back
            with spill:
                return self._run_variant(args, block, precision, recomputes, backward_follows=True)
        return self._run_variant(args, block, precision, recomputes, backward_follows=torch.is_grad_enabled())

    def _residual_stream_needing_grad(self, args: tuple) -> tuple:
        """`args` with the residual stream needing grad where the block trains but its stream does not (a first
        block after a frozen embedding), so it shares the later blocks' training variant (residual_hints.py)."""
        inputs = args[:-4]
        residual = self._residual_inputs()
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in inputs) or all(
                inputs[i].requires_grad for i in residual):
            return args  # nothing trains here (no backward), or the stream needs grad already
        if self.ctx.variants.bundle is not None:  # a later run's compile_blocks does it before Dynamo traces
            residual_hints.remember(self.ctx.variants.bundle.path, self.ctx.runtime.blocks[self.block],
                                    self.template, [i for i in residual if not inputs[i].requires_grad])
        return tuple(a.detach().requires_grad_() if i in residual and not a.requires_grad else a
                     for i, a in enumerate(inputs)) + tuple(args[-4:])

    def _run_variant(self, args: tuple, block: int, precision: str, recomputes: bool, backward_follows: bool):
        """Run the compiled variant for the block's layout, `precision` and grad mode. `backward_follows`: grad is
        on or this is a recompute's forward (its training variants are worth compiling ahead)."""
        rt = self.ctx.runtime
        # A recomputed block's forward (grad off; a backward follows) may run eagerly while workers compile.
        defer = recomputes and backward_follows and not torch.is_grad_enabled()
        compiled, eager = self._variant_for(args, block, precision, recomputes, defer)
        # Run eagerly, its W8A16 tuning waits for the wait on the worker (kernels/tuning/deferral.py).
        key = self.last_key
        try:
            with kernels.deferred_tuning() if eager else contextlib.nullcontext():
                out = compiled(*args)
        except BaseException:
            rt.abort_held_blocks()  # the evict inside never ran; don't leave the slot held
            raise
        if not eager and self.ctx.variants.first_run(key):  # counted once it ran: its first launches are in it
            rt.record_first_run()
        return out

    def _variant_for(self, args: tuple, block: int, precision: str, recomputes: bool, defer: bool):
        """(compiled variant, False), compiled on first use; or with `defer`, while workers compile it, (variant
        graph, True) to run eagerly."""
        rt = self.ctx.runtime
        gm, skey, vctx = self.variant_graph(precision, rt_trainable(rt, block), block)
        # Replaying random numbers compiles differently; a graph drawing none is shared by kept and recomputed blocks.
        replay_rng = recomputes and self._random[skey]
        # Token inputs (the last four) differ per block by value only; leave them out of the key.
        key = self.last_key = (skey, self.signature(args[:-4]), torch.is_grad_enabled(), self.ctx.options.inner,
                               replay_rng)
        self.variants_ran.setdefault(key, precision)
        compiled = self.ctx.variants.get(key, args)
        if compiled is None:
            label = self._label(skey, precision, block)
            if defer and (self._compiling_ahead(key) or (
                    key not in self._training_of and self._compile_ahead(args, block, precision, recomputes, label))):
                return gm, True  # eagerly, while a worker compiles it
            compiled = self._compile(key, gm, args, label, True, PassLog(vctx.passes_ran), replay_rng)
        return compiled, False
