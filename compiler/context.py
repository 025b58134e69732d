"""What the passes share: the runtime's static facts (the `StreamingRuntime` protocol, interface.py), options,
and a log of the passes that ran. Every context is a `PassLog`: `run(passes, target)` records per pass its name
and the notes it made through `note()`, which `explain()` prints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch

from torch_stagehand.compiler.interface import StreamingRuntime
from torch_stagehand.environment import env

if TYPE_CHECKING:
    import networkx as nx
    from torch_stagehand.compiler.variants import VariantCache

log = logging.getLogger("torch_stagehand.compiler")

INNER_COMPILERS = ("inductor", "eager")
RECOMPUTE_MODES = (None, "blocks", "model")
LINEAR_MATH = ("graph", "op")
EXPERTS_MATH = ("grouped", "dense")


class BackendOptionsError(ValueError):
    pass


# Two workers: Flux-dev int8's cold first step 22.4 s -> 7.3 s, Qwen2.5-7B's to its third step the same (H200,
# benches/results/start_time_default_*.json). Each holds a CUDA context (0.5-0.6 GiB there) outside the budget.
DEFAULT_AHEAD_WORKERS = 2


def default_ahead_workers(device: torch.device) -> int:
    """STAGEHAND_AHEAD_WORKERS if set, else DEFAULT_AHEAD_WORKERS on CUDA (none on the CPU, where Inductor's
    compile is slow and a worker's is as slow)."""
    workers = env("STAGEHAND_AHEAD_WORKERS")
    if workers is not None:
        return workers
    return DEFAULT_AHEAD_WORKERS if device.type == "cuda" else 0


@dataclass(frozen=True)
class BackendOptions:
    """What `torch.compile(model, backend="stagehand", options={...})` takes; an unknown name or value is a
    `BackendOptionsError` naming it."""

    inner: str = "inductor"
    """The compiler of each unit's graph: "inductor" (Triton kernels) or "eager" (the graph's ops as they are: the
    reference that shows what the compiler contributes)."""
    recompute: str | None = None
    """'blocks': every block recomputes its forward in backward (saves its inputs, not its activations), whatever
    the model's own checkpointing flag; None: only the blocks the model itself checkpoints; "model": the model
    checkpoints every block outside the compiled graph, which `compile_blocks` moved in here (each block
    recomputes where no plan says otherwise). With a VRAM plan, the plan decides (except under "blocks")."""
    linear_math: str = "graph"
    """'graph': a precision that can write its linear as graph ops (fp8 on FP8 tensor cores) is traced into the
    block's graph, where Inductor fuses its quantization and calls its GEMM directly; "op": every streamed linear
    stays the opaque `stagehand::linear` op (the A/B reference)."""
    experts_math: str = "grouped"
    """'grouped': a one-byte expert stack (int8, fp8) that the model reads only through grouped GEMMs is multiplied
    from its bytes (`stagehand::grouped_experts`: the Triton kernel or dequantize + grouped_mm, whichever the
    autotuner measures faster; fp8 rowwise tensor cores); "dense": the stack is dequantized in the graph and the
    model's own GEMM reads it (the A/B reference)."""
    ahead_workers: int | None = None
    """Worker processes that compile foreseen block variants while the step runs (compiler/startup/ahead.py); None:
    the environment's STAGEHAND_AHEAD_WORKERS, else `DEFAULT_AHEAD_WORKERS` on CUDA and none on the CPU."""

    def workers_ahead(self, device: torch.device) -> int:
        """How many ahead-compile workers the variants get (none with "eager", which keeps no cache to fill)."""
        if self.inner != "inductor":
            return 0
        return self.ahead_workers if self.ahead_workers is not None else default_ahead_workers(device)

    @staticmethod
    def from_dict(options: dict[str, Any] | None) -> "BackendOptions":
        options = dict(options or {})
        names = [f.name for f in fields(BackendOptions)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise BackendOptionsError(f"backend 'stagehand': unknown option(s) {unknown} (known: {', '.join(names)})")
        for name, allowed in (("experts_math", EXPERTS_MATH), ("linear_math", LINEAR_MATH),
                              ("recompute", RECOMPUTE_MODES), ("inner", INNER_COMPILERS)):
            if name in options and options[name] not in allowed:
                raise BackendOptionsError(
                    f"backend 'stagehand': options['{name}'] must be one of {allowed}, got {options[name]!r}")
        workers = options.get("ahead_workers")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
            raise BackendOptionsError(
                f"backend 'stagehand': options['ahead_workers'] must be an int >= 0, got {workers!r}")
        return BackendOptions(**options)


T = TypeVar("T")


def compiler_pass(name: str):
    """Name a pass: `@compiler_pass("rewrite_linear") def rewrite_linear(gm, ctx) -> gm`."""

    def mark(fn: T) -> T:
        fn.name = name  # type: ignore[attr-defined]
        return fn

    return mark


@dataclass
class PassRecord:
    """One pass that ran: its name and what it said it changed."""

    name: str
    notes: list[str] = field(default_factory=list)


class PassLog:
    """Runs ordered pass lists and keeps, in order, the passes that ran with their notes."""

    def __init__(self, passes_ran: Sequence[PassRecord] = ()) -> None:
        self.passes_ran: list[PassRecord] = list(passes_ran)

    def run(self, passes: Sequence[Callable], target: T) -> T:
        for compiler_pass_ in passes:
            self.passes_ran.append(PassRecord(compiler_pass_.name))
            target = compiler_pass_(target, self)
        return target

    def note(self, message: str) -> None:
        """Say what the running pass changed (logged at debug level, listed by explain)."""
        record = self.passes_ran[-1] if self.passes_ran else PassRecord("(outside a pass)")
        record.notes.append(message)
        log.debug("[%s] %s", record.name, message)


class CompileContext(PassLog):
    """The graph-level context: one per Dynamo graph."""

    def __init__(self, runtime: StreamingRuntime, options: BackendOptions, variants: "VariantCache",
                 variant_passes: Sequence[Callable], joint_passes: Sequence[Callable], graph_id: int = 0,
                 tokens: dict[str, tuple[Any, int]] | None = None):
        super().__init__()
        self.tokens = dict(tokens or {})  # the graph's block-token inputs (graph_nodes.token_owners)
        self.runtime = runtime
        self.options = options
        self.variants = variants  # compiled variants of this runtime (shared across graphs)
        self.variant_passes = tuple(variant_passes)
        self.joint_passes = tuple(joint_passes)
        self.graph_id = graph_id
        self.segments: list = []  # set by assign_segments: its Segments, in graph order
        self.dag: "nx.DiGraph | None" = None  # set by assign_segments: the segment DAG

    @property
    def device(self) -> torch.device:
        return self.runtime.device


class VariantContext(PassLog):
    """What a per-variant pass reads: the block, its precision, and the positions of its layers that train."""

    def __init__(self, parent: CompileContext, block: int, precision: str, trainable: tuple[int, ...] = ()):
        super().__init__()
        self.parent = parent
        self.block = block
        self.precision = precision
        self.trainable = trainable

    @property
    def runtime(self) -> StreamingRuntime:
        return self.parent.runtime

    @property
    def device(self) -> torch.device:
        return self.parent.device
