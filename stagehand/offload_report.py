"""What `offload()` did, said once (also in `rt.stats()["offload"]` and explain's report), and the first call's
progress. A block list that `blocks="auto"` skipped although it holds Linear weights is a `BlockListSkippedWarning`.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from torch_stagehand.runtime.blocks import is_streamable_linear
from torch_stagehand.runtime.host.plan import host_report


class BlockListSkippedWarning(UserWarning):
    """`blocks="auto"` left out an nn.ModuleList that holds Linear weights (they stay resident)."""


@dataclass
class BlockList:
    fqn: str
    children: int
    streamed: bool
    reason: str = ""  # why it was skipped; "" when streamed

    def describe(self) -> str:
        if self.streamed:
            return f"{self.fqn or '(model)'} ({self.children} blocks, streamed)"
        return f"{self.fqn} skipped: {self.reason}"


def _skip_reason(module: nn.ModuleList) -> str:
    """Why `blocks="auto"` does not take this list (the rules of `runtime.blocks._repeated_block_lists`)."""
    classes = sorted({type(c).__name__ for c in module})
    if len(module) < 2:
        return (f"{len(module)} block ({', '.join(classes) or 'empty'}); a block list needs at least 2 repeated "
                f"blocks: name it in blocks=[...] to stream it")
    if len(classes) > 1:
        return f"children of {len(classes)} classes ({', '.join(classes)}), not repeated blocks"
    return "a child holds no nn.Linear"


def survey_block_lists(model: nn.Module, block_fqns: list[str]) -> list[BlockList]:
    """The outermost nn.ModuleLists of `model` that hold Linear weights, and whether their children stream."""
    chosen = set(block_fqns)
    lists: list[BlockList] = []
    seen: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(s + ".") for s in seen):
            continue  # lists inside a list (attention's to_out, MoE experts) are part of their block
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or not any(
                is_streamable_linear(m) and m.weight.numel() for m in module.modules()):
            continue
        children = [f"{name}.{c}" if name else c for c, _ in module.named_children()]
        streamed = [c for c in children if c in chosen]
        if not streamed and isinstance(module, nn.Sequential):
            continue  # a Sequential that is not a block list (an MLP, a head) is not a candidate
        seen.append(name)
        lists.append(BlockList(name, len(streamed), True) if streamed
                     else BlockList(name, len(children), False, _skip_reason(module)))
    return lists


@dataclass
class OffloadSummary:
    device: str
    blocks: int
    streamed_layers: int
    block_lists: list[BlockList]
    precision_blocks: dict[str, int]
    precision_bytes: dict[str, int]
    forward_bytes: int  # one forward streams each block once, in its precision
    host_bytes: int
    pinned: bool  # the store page-locks what streams (a CUDA device)
    slots: int
    slot_bytes: int
    host_by_kind: dict[str, int]  # stats()["host"]["bytes_by_kind"]: copy -> bytes
    keep_full: str
    seconds: dict[str, float] = field(default_factory=dict)
    beside: dict[str, float] = field(default_factory=dict)  # work on other threads beside a stage (StageClock)
    expert_stacks: int = 0  # MoE expert stacks among the streamed layers (3-D parameters)
    expert_bytes: int = 0  # their full-precision bytes
    node_shared: str = ""  # NodeStore.describe(): the ranks of this node share one host store
    rows_behind: str = ""  # a slab's rows still read behind offload (read_process.RowsBehind), when it returned

    def host_line(self) -> str:
        """Where each host copy is: "11,846.4 MB int8 pinned, 23,668.5 MB bf16 file" (not one word for all)."""
        kinds = ", ".join(f"{n / 1e6:,.1f} MB {kind}" for kind, n in self.host_by_kind.items())
        return f"{kinds} (keep_full={self.keep_full!r}" + (f"; {self.node_shared})" if self.node_shared else ")")

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["block_lists"] = [dict(b.__dict__) for b in self.block_lists]
        d["training_step_bytes_max"] = 2 * self.forward_bytes
        return d

    def lines(self) -> list[str]:
        mb = lambda n: f"{n / 1e6:,.1f} MB"  # noqa: E731
        precision = ", ".join(f"{p} {n} block{'s' * (n != 1)} ({mb(self.precision_bytes[p])})"
                              for p, n in self.precision_blocks.items())
        # The stages that took a twentieth of a second or more (every stage is in `seconds`).
        slow = [f"{k} {v:.2f} s" for k, v in self.seconds.items() if k != "total" and v >= 0.05]
        took = (", ".join(slow) + ("; the other stages less" if len(slow) < len(self.seconds) - 1 else "")
                if slow else "every stage under 0.05 s")
        beside = "; beside them " + ", ".join(f"{k} {v:.2f} s" for k, v in self.beside.items()) if self.beside else ""
        return [
            f"stagehand offload: {self.blocks} blocks, {self.streamed_layers} streamed Linears"
            + (f" and {self.expert_stacks} expert stacks ({mb(self.expert_bytes)})" if self.expert_stacks else "")
            + f", device {self.device}",
            "  block lists: " + "; ".join(b.describe() for b in self.block_lists),
            f"  precision: {precision}",
            f"  streamed per step: {mb(self.forward_bytes)} per forward (each block once); a training step up to "
            f"{mb(2 * self.forward_bytes)} (forward + backward, less what the slots keep across the turn)",
            f"  host store: {self.host_line()}; device slots: {self.slots} x {mb(self.slot_bytes)}",
            f"  took {self.seconds.get('total', 0.0):.2f} s ({took}{beside})",
        ] + ([f"  slab rows: {self.rows_behind}"] if self.rows_behind else [])

    def __str__(self) -> str:
        return "\n".join(self.lines())


def summarize(model: nn.Module, rt, clock) -> OffloadSummary:
    """What offload did; `clock` is its StageClock (runtime/telemetry/stage_clock.py)."""
    precision = rt.precision
    counts = Counter(precision.values())
    host = host_report(rt.store)
    behind = rt.store.rows_behind
    per_precision: Counter = Counter()
    for block, p in precision.items():
        per_precision[p] += rt.block_nbytes(block, p)
    return OffloadSummary(
        device=str(rt.device), blocks=len(rt.blocks), streamed_layers=sum(not s.experts for s in rt.layers),
        expert_stacks=sum(bool(s.experts) for s in rt.layers),
        expert_bytes=sum(s.weight.numel() * s.weight.element_size() for s in rt.layers if s.experts),
        block_lists=survey_block_lists(model, rt.blocks),
        precision_blocks=dict(counts), precision_bytes=dict(per_precision), forward_bytes=sum(per_precision.values()),
        host_bytes=rt.store.host_bytes(), pinned=bool(rt.store.pin), slots=len(rt.pool.slots),
        slot_bytes=rt.pool.slot_bytes, seconds={k: round(v, 3) for k, v in clock.done().items()},
        beside={k: round(v, 3) for k, v in clock.overlapped.items()},
        host_by_kind=host["bytes_by_kind"], keep_full=host["keep_full"],
        node_shared=rt.store.node.describe() if rt.store.node is not None else "",
        rows_behind="" if behind is None or behind.done else (
            f"{behind.blocks_in} of {len(rt.store.blocks)} blocks in; the reader process reads the rest behind "
            "offload (the first fetch of an INT8 block waits for them)"),
    )


def report_offload(summary: OffloadSummary, auto: bool, verbose: bool) -> None:
    """Print the summary to stderr (once per offload) and warn about block lists `auto` skipped."""
    if verbose:
        print(summary, file=sys.stderr, flush=True)
    if auto:
        for b in summary.block_lists:
            if not b.streamed:
                warnings.warn(f"stagehand offload: blocks='auto' skipped the block list {b.fqn}: {b.reason}; "
                              "its Linear weights stay resident on the device", BlockListSkippedWarning, stacklevel=3)


def first_step_line(record: dict[str, Any], stats: dict[str, Any]) -> str:
    """One line after the first recorded step: what the first call cost (it compiles)."""
    phases = record.get("phase_durations", {})
    total = sum(phases.values())
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items() if v >= 0.005)
    loaded = stats.get("units_loaded", 0)
    cache = f"; {loaded} loaded from the compile cache" if loaded else ""
    behind = stats.get("slab_rows_behind") or {}
    waited = f"; it waited {behind['waited_s']:.1f} s for the slab's rows" if behind.get("waited_s") else ""
    return (f"stagehand: first step took {total:.1f} s ({parts}); it compiled {stats['compiled_units']} units "
            f"({stats['compiled_variants']} block variants{cache}) in {stats['compile_seconds']:.1f} s; "
            f"later steps reuse them{waited}")


class FirstCallProgress:
    """What the first call is doing while it compiles: a line when the backend got its first graph,
    a live counter of compiled units on a terminal, and one line with the totals after the first step."""

    def __init__(self, rt, stream=None):
        self.rt = rt
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.units = self.variants = self.loaded = 0
        self.seconds = 0.0
        self.announced = False
        rt.events.compile_listeners.append(self.on_compile)
        rt.events.step_listeners.append(self.on_step)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def on_compile(self, kind: str, seconds: float, loaded: bool = False) -> None:
        if kind == "graph":
            if not self.announced:
                self.announced = True
                self._write("stagehand: first call: Dynamo traced a block; compiling one variant per block "
                            "structure and precision as they first run ...\n")
            return
        self.units += 1
        self.variants += kind == "block variant"
        self.loaded += loaded
        self.seconds += seconds
        if self.live:
            expected = self._expected()
            of = f" of ~{expected}" if expected >= self.units else ""
            left = (f", ~{(expected - self.units) * self.seconds / self.units:.0f} s left"  # at this run's pace
                    if expected > self.units else "")
            cache = f", {self.loaded} loaded from the compile cache" if self.loaded else ""
            self._write(f"\r  compiled {self.units}{of} units ({self.variants} block variants{cache}) "
                        f"in {self.seconds:.1f} s{left}")

    def _expected(self) -> int:
        """The units the last run of this model had when it wrote its compile bundle (0: no earlier run)."""
        from torch_stagehand.compiler.variants import variant_cache

        bundle = variant_cache(self.rt).bundle
        return 0 if bundle is None else bundle.last_run_units

    def on_step(self, record: dict[str, Any]) -> None:
        self.rt.events.compile_listeners.remove(self.on_compile)
        self.rt.events.step_listeners.remove(self.on_step)
        if self.live and self.units:
            self._write("\n")
        self._write(first_step_line(record, self.rt.stats()) + "\n")
