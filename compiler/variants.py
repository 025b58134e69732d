"""The compiled-variant cache: one per runtime, owned by the compiler (the runtime only calls its `on_close`). Keyed
by (structure key, input signature, grad mode, inner compiler, rng replay); a shape-generic key holds no sizes and
its variants are told apart by their guards (symbolic.py). It lives as long as its runtime, so a Dynamo recompile or
a precision switch re-links variants compiled before."""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Callable, Hashable

import torch

from torch_stagehand.environment import env
from torch_stagehand.runtime.blocks import layout_fingerprint

from torch_stagehand.compiler.startup.ahead import AheadCompiler
from torch_stagehand.compiler.startup.compile_cache import CompileBundle
from torch_stagehand.compiler.interface import StreamingRuntime
from torch_stagehand.compiler.symbolic import Guard, GuardedVariants


class VariantCache:
    def __init__(self, bundle: CompileBundle | None = None) -> None:
        self.bundle = bundle  # this model's compiled units on disk (compiler/startup/compile_cache.py); None: off
        self.compiled_before = _written(bundle)  # by a run before this one (asked before this run writes it)
        self._bundle_loaded = False
        self.compiled: dict[Hashable, Callable] = {}
        self.info: dict[Hashable, dict[str, Any]] = {}  # label, graphs, scheduled, seconds, passes (explain)
        self.warned_shapes = False  # the second-input-shape warning is given once per runtime
        self.shapes_seen: dict[Hashable, set[tuple]] = {}  # static variants: input shapes per structure key
        self.ahead: AheadCompiler | None = None  # workers compiling foreseen variants; set by the backend
        self._ran: set[Hashable] = set()  # the variants that have run once (`first_run`)

    def first_run(self, key: Hashable) -> bool:
        """Is this the end of `key`'s first run (whose one-time kernel loads a calibration must not measure)?"""
        if key in self._ran:
            return False
        self._ran.add(key)
        return True

    def warn_on_a_second_shape(self, structure: str, args: tuple, label: str, block_variant: bool) -> None:
        """A static variant met its second shape: every new size will recompile every block. Say so, once."""
        shapes = self.shapes_seen.setdefault(structure, set())
        shapes.add(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor) and a.dim() > 0))
        if not block_variant or self.warned_shapes or len(shapes) < 2:
            return
        self.warned_shapes = True
        warnings.warn(f"stagehand: {label} is compiling for a second input shape with static shapes "
                      f"({len(self)} units compiled so far), so every new batch or sequence length recompiles every "
                      "block. Leave torch.compile's `dynamic` unset (Dynamo then makes the changing dimensions dynamic "
                      "and each block compiles once for all sizes) or pad inputs to a few bucket sizes (said once per "
                      "offloaded model)", stacklevel=2)

    def use_ahead(self, workers: int) -> "AheadCompiler | None":
        """The runtime's ahead-compile workers, made once; None when a run before compiled the model (its bundle
        is on disk: the variants load faster than a worker starts)."""
        if self.ahead is not None and self.ahead.size != workers:  # the backend's option overrides the environment
            self.ahead.close()
            self.ahead = None
        if self.ahead is None and workers > 0 and not self.compiled_before:
            self.ahead = AheadCompiler(workers)
        return self.ahead

    def adopt_ahead(self, pool: AheadCompiler) -> None:
        """Take the workers `start_ahead_at_offload` started for this model (closed with the runtime)."""
        if self.ahead is not None:
            pool.close()
        else:
            self.ahead = pool

    def get(self, key: Hashable, args: tuple = ()) -> Callable | None:
        """The variant for `key`; for a shape-generic key, the first whose guard accepts `args`."""
        entry = self.compiled.get(key)
        return entry.find(args) if isinstance(entry, GuardedVariants) else entry

    def add(self, key: Hashable, compiled: Callable, info: dict[str, Any], guard: Guard | None = None) -> None:
        if guard is None:
            self.compiled[key] = compiled
        else:
            self.compiled.setdefault(key, GuardedVariants()).add(guard, compiled)
        self.info[key] = info

    def before_compile(self) -> None:
        """The first compile of this runtime loads the model's bundle into torch's caches (once)."""
        if self.bundle is not None and not self._bundle_loaded:
            self._bundle_loaded = True
            self.bundle.load()

    def after_compile(self, loaded: bool, by_worker: bool = False) -> None:
        """A unit compiled cold, here or by a worker (`by_worker`): write the bundle again, so a run killed later
        still leaves what it compiled and the next run knows the model is compiled."""
        if self.bundle is not None and (not loaded or by_worker):
            self.bundle.save(units=len(self.info), even_empty=by_worker)

    def why_new(self, key: tuple) -> str:
        """What `key` differs in from the nearest variant of its structure ("new structure" when there is none)."""
        names = ("signature", "grad mode", "inner compiler", "random-number replay")
        best: list[str] | None = None
        for other in self.compiled:
            if other[0] != key[0] or len(other) != len(key):
                continue
            diff = [names[i - 1] for i in range(1, len(key)) if other[i] != key[i]]
            if "signature" in diff:
                inputs = [f"input {n}: {b} -> {a}" for n, (a, b) in enumerate(zip(key[1], other[1])) if a != b]
                diff[diff.index("signature")] = "; ".join(inputs[:2]) or "signature"
            if best is None or len(diff) < len(best):
                best = diff
        return "new structure" if best is None else ", ".join(best)

    def count_structure(self, structure: Hashable) -> int:
        """How many variants share this structure key (one per input signature / guard / grad mode)."""
        return sum(len(entry) if isinstance(entry, GuardedVariants) else 1
                   for key, entry in self.compiled.items() if key[0] == structure)

    def clear(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None
        self.compiled.clear()
        self.info.clear()
        self._ran.clear()

    def __len__(self) -> int:
        return sum(len(e) if isinstance(e, GuardedVariants) else 1 for e in self.compiled.values())


_caches: "weakref.WeakKeyDictionary[Any, VariantCache]" = weakref.WeakKeyDictionary()


def _bundle_of(fingerprint: str, device) -> CompileBundle | None:
    return CompileBundle.for_model(fingerprint, device) if env("STAGEHAND_COMPILE_CACHE") else None


def _written(bundle: CompileBundle | None) -> bool:
    """Did a run before this one compile the model (its bundle is on disk)?"""
    return bundle is not None and os.path.exists(bundle.path)


def start_ahead_at_offload(device, blocks: list[str], layers, workers: int,
                           w8a16: dict | None = None) -> AheadCompiler | None:
    """At offload: start `workers` ahead-compile workers (unless a run before compiled this model), importing
    torch's compiler while offload works; `VariantCache.adopt_ahead` takes them. `w8a16`: kernels to compile first."""
    if workers <= 0 or _written(_bundle_of(layout_fingerprint(device.type, blocks, layers), device)):
        return None
    return AheadCompiler(workers, w8a16=w8a16).start()


def variant_cache(rt: StreamingRuntime) -> VariantCache:
    """The runtime's variant cache (created on first use; emptied when the runtime closes)."""
    cache = _caches.get(rt)
    if cache is None:
        # Named by the blocks and layers, not the precision map: one file holds the variants of every map used.
        fingerprint = layout_fingerprint(rt.device.type, rt.blocks, rt.layers)
        cache = _caches[rt] = VariantCache(_bundle_of(fingerprint, rt.device))
        rt.on_close(cache.clear)
    return cache
