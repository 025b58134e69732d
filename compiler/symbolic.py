"""Shape-generic units: compile once for every size of the dimensions Dynamo made dynamic. `SymbolicInputs` fakes a
unit's real inputs with those dimensions symbolic in a fresh `ShapeEnv`. Whatever the compile assumed about the sizes
(static ones included) comes back as a guard over the inputs, checked before a variant runs (`GuardedVariants`): a
call that breaks one compiles another variant."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from torch_stagehand.compiler.graph_nodes import example_value


def _is_symbolic(value: Any) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(not isinstance(s, int) for s in value.shape)


def input_key(a: Any, exact_sizes: bool, grad: bool = True) -> Any:
    """One input's part of a variant key: with `exact_sizes`, a tensor's shape and strides too; without, only what
    a shape-generic variant's guard does not check. Without `grad` (grad mode) the grad flag is left out."""
    if isinstance(a, torch.Tensor) and a.dim() == 0 and a.device.type == "cpu":
        # A Python float Dynamo passed as a tensor, compiled in as a constant (inner._bake_scalar_reads): by value.
        return (a.dtype, a.requires_grad and grad, a.item())
    if isinstance(a, torch.Tensor):
        if exact_sizes:
            return (tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad and grad)
        return (a.dtype, a.device, a.dim(), a.requires_grad and grad)
    if not exact_sizes and (isinstance(a, (int, float, bool)) or a is None):
        return type(a).__name__  # a SymInt's value: the guard checks it
    return a


@dataclass(frozen=True)
class SymbolicInputs:
    """Which inputs of a unit are symbolic, and in which dimensions (None for a plain input)."""

    dims: tuple[tuple[bool, ...] | None, ...]  # per placeholder: per-dim dynamic flags for a tensor
    symints: tuple[bool, ...]  # per placeholder: a SymInt (a size Dynamo passes as an int)

    @staticmethod
    def of(gm: fx.GraphModule) -> "SymbolicInputs | None":
        """The symbolic inputs of `gm`, or None when Dynamo gave it static shapes."""
        values = [example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
        if not any(_is_symbolic(v) for v in values):
            return None
        dims = tuple(tuple(not isinstance(s, int) for s in v.shape) if isinstance(v, torch.Tensor) else None
                     for v in values)
        return SymbolicInputs(dims, tuple(isinstance(v, torch.SymInt) for v in values))

    def fake(self, args: Sequence[Any]) -> "FakedInputs":
        """Fake `args` in a fresh ShapeEnv, the dynamic dimensions symbolic."""
        from torch._dynamo.source import ConstantSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        shape_env = ShapeEnv()  # duck sizing: inputs of equal size share a symbol (and a guard says so)
        mode = FakeTensorMode(shape_env=shape_env)
        fakes: list[Any] = []
        for i, a in enumerate(args):
            # Inputs past the Dynamo graph's own (a block variant's transfer tokens) are static.
            dims, symint = (self.dims[i], self.symints[i]) if i < len(self.dims) else (None, False)
            source = ConstantSource(f"stagehand_input_{i}")
            if isinstance(a, torch.Tensor):
                dynamic = dims if dims is not None and len(dims) == a.dim() else (False,) * a.dim()
                context = StatelessSymbolicContext(
                    dynamic_sizes=[DimDynamic.DUCK if d else DimDynamic.STATIC for d in dynamic])
                # No source for a 0-dim CPU tensor: the fake mode would make its value symbolic (only Dynamo can).
                fakes.append(mode.from_tensor(a, source=None if a.dim() == 0 and a.device.type == "cpu" else source,
                                              symbolic_context=context))
            elif symint and isinstance(a, int):
                symbol = shape_env.create_symbol(a, source=source, dynamic_dim=DimDynamic.DUCK)
                fakes.append(shape_env.create_symintnode(symbol, hint=a, source=source))
            else:
                fakes.append(a)
        return FakedInputs(mode, fakes)


def fake_static(args: Sequence[Any]) -> "FakedInputs":
    """Fake `args` with every size static in a fresh ShapeEnv, without which torch's compile caches bypass."""
    return SymbolicInputs((), ()).fake(args)


@dataclass
class FakedInputs:
    mode: Any  # FakeTensorMode
    values: list[Any]

    def tracing(self):
        """The context the inner compiler runs in: Dynamo's, with our fake mode."""
        from torch._guards import TracingContext, tracing

        return tracing(TracingContext(self.mode))

    def guard(self) -> "Guard":
        """The sizes this compile assumed, as a check over real inputs."""
        shape_env = self.mode.shape_env
        positions = [i for i, v in enumerate(self.values) if isinstance(v, (torch.Tensor, torch.SymInt))]
        code = shape_env.produce_guards_expression([self.values[i] for i in positions], ignore_static=False)
        return Guard(positions, code)


class Guard:
    """A guard expression over some of a unit's inputs, compiled once (it runs before every call)."""

    def __init__(self, positions: list[int], code: str | None):
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP  # what the expression's functions resolve to

        self.positions, self.code = positions, code
        self._globals = dict(SYMPY_INTERP)
        self._compiled = None if code is None else compile(code, "<stagehand unit guard>", "eval")

    def __call__(self, args: Sequence[Any]) -> bool:
        if self._compiled is None:
            return True
        inputs = {f"t{n}": args[i] for n, i in enumerate(self.positions)}
        return bool(eval(self._compiled, self._globals, {"L": inputs}))  # noqa: S307 - our own guard code


@dataclass
class GuardedVariants:
    """The variants compiled under one coarse key, each valid where its guard holds (first match runs)."""

    entries: list[tuple[Guard, Callable]] = field(default_factory=list)

    def find(self, args: Sequence[Any]) -> Callable | None:
        return next((compiled for guard, compiled in self.entries if guard(args)), None)

    def add(self, guard: Guard, compiled: Callable) -> None:
        self.entries.append((guard, compiled))

    def __len__(self) -> int:
        return len(self.entries)
