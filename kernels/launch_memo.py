"""Launches worked out once and replayed with new tensors: the host side of a W8A16 call. The first call with a key
(`tensor_key` of each tensor argument) runs through an `Executor` that records the buffers it allocated and each step
(a compiled binary with its grid and arguments, or a torch call); later calls allocate the same buffers and call each
binary's launcher directly (`Replay`), skipping Triton's per-call binding. Recorded only if the replay can supply
every tensor a launch received, never under the interpreter or a launch hook."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch


@functools.cache
def _triton_runtime_knobs():
    from triton import knobs  # only asked where Triton imported (triton >= 3.6 has knobs)

    return knobs.runtime


def _launch_hook_set() -> bool:
    """Is a Triton launch hook installed (a profiler)? Then every launch goes through Triton."""
    runtime = _triton_runtime_knobs()
    # Triton 3.6 keeps each hook as a HookChain (never None; empty when nothing is installed).
    return any(hook is not None and bool(getattr(hook, "calls", True))
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def tensor_key(t: torch.Tensor | None):
    """What a launch depends on in one tensor argument: shape, strides, dtype, device, 16-byte alignment."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0)


def bind(fn, args: tuple, kwargs: dict) -> list:
    """The kernel's arguments in signature order (what a compiled binary's launcher takes), defaults filled."""
    values = dict(zip(fn.arg_names, args))
    for name, value in kwargs.items():
        if name in fn.arg_names:
            values[name] = value
    out = []
    for param in fn.params:
        if param.name in values:
            out.append(values[param.name])
        elif param.has_default:
            out.append(param.default)
        else:
            raise TypeError(f"{fn.arg_names}: no value for {param.name!r}")
    return out


@dataclass
class KernelStep:
    """One compiled Triton binary: grid and arguments fixed, the tensors named by role."""

    compiled: object
    grid: tuple[int, int, int]
    args: list
    roles: list[tuple[int, str]]  # (argument index, role) filled per call

    def __call__(self, tensors: dict, stream: int) -> None:
        args = list(self.args)
        for index, role in self.roles:
            args[index] = tensors[role]
        c = self.compiled
        c.run(*self.grid, stream, c.function, c.packed_metadata, None, None, None, *args)


class Executor:
    """Runs one call's launches (the slow path) and, with `record=True`, writes them down for a `Replay`."""

    def __init__(self, tensors: dict, record: bool, constants: tuple = (), compile_only: bool = False):
        self.tensors = dict(tensors)
        self.record = record and not compile_only
        self.recordable = self.record
        self.compile_only = compile_only  # compile each Triton kernel (`warmup`), launch nothing (tune.precompile)
        self.steps: list = []
        self.buffers: list[tuple[str, tuple, torch.dtype]] = []
        self._constant_ids = {id(t) for t in constants}

    def buffer(self, role: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer allocated in the call (output, split workspace, dequantized weight): a replay allocates it anew."""
        t = torch.empty(shape, dtype=dtype, device=device)
        self.tensors[role] = t
        if self.record:
            self.buffers.append((role, tuple(shape), dtype))
        return t

    def kernel(self, fn, grid: tuple, *args, **kwargs):
        if self.compile_only:
            return fn.warmup(*args, grid=grid, **kwargs)
        compiled = fn[grid](*args, **kwargs)
        if self.recordable:
            self._record_kernel(fn, grid, args, kwargs, compiled)
        return compiled

    def torch(self, fn: Callable[[dict], None]) -> None:
        if self.compile_only:
            return
        fn(self.tensors)
        if self.recordable:  # a step, as a KernelStep is: (tensors, stream)
            self.steps.append(lambda tensors, stream: fn(tensors))

    def _record_kernel(self, fn, grid, args, kwargs, compiled) -> None:
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            self.recordable = False  # not a compiled binary (an interpreter's function): nothing to replay
            return
        role_of = {id(t): role for role, t in self.tensors.items() if t is not None}
        values = bind(fn, args, kwargs)
        roles = []
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                if id(v) in role_of:
                    roles.append((i, role_of[id(v)]))
                    values[i] = None
                elif id(v) not in self._constant_ids:
                    self.recordable = False  # a tensor the replay could not supply
                    return
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self.steps.append(KernelStep(compiled, grid3, values, roles))

    def replay(self, device) -> "Replay | None":
        if not (self.recordable and self.steps):
            return None
        return Replay(device, list(self.buffers), list(self.steps))


@dataclass
class Replay:
    """A recorded call: allocate its buffers, run its steps on the current stream."""

    device: torch.device
    buffers: list
    steps: list
    hits: int = field(default=0)

    def __call__(self, tensors: dict) -> dict:
        for role, shape, dtype in self.buffers:
            tensors[role] = torch.empty(shape, dtype=dtype, device=self.device)
        # Triton's own launch path asks torch for the same raw handle.
        stream = torch._C._cuda_getCurrentRawStream(self.device.index) if self.device.type == "cuda" else 0
        for step in self.steps:
            step(tensors, stream)
        self.hits += 1
        return tensors


class LaunchMemo:
    """key -> Replay for one launcher; a miss runs the slow path, which may add the key."""

    def __init__(self, name: str):
        self.name = name
        self.replays: dict = {}
        self.misses = 0

    def enabled(self, interpreting: bool) -> bool:
        return not interpreting and not _launch_hook_set()

    def get(self, key):
        return self.replays.get(key)

    def add(self, key, executor: Executor, device) -> None:
        self.misses += 1
        replay = executor.replay(device)
        if replay is not None:
            self.replays[key] = replay

    def clear(self) -> None:
        self.replays.clear()
        self.misses = 0

    def stats(self) -> dict:
        return {"keys": len(self.replays), "hits": sum(r.hits for r in self.replays.values()), "misses": self.misses}
