"""Calibration: one training step under the smallest plan (every block streamed and recomputed: it fits any budget a
plan fits and shows both sides of each activation decision), turned into the planner's cost model.

Per block: `input_bytes` (allocated between two blocks' forward waits), `activation_bytes` (between its recompute's
`wait` and its backward's `wait_bw`), `forward_s` / `backward_s` (CUDA events, read once at the step's end),
`host_s` (`HostClock`) and `host_fetch_share` (the part in schedule ops, which a resident block mostly skips). On the
CPU the clock is the host's and memory reads zero, so the CI runs the same path. `base_bytes` is the peak beyond the
predicted blocks; `other_s` the time beyond them, at least the GPU's measured time outside the blocks.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from torch_stagehand.runtime.device.allocator import allocated_bytes
from torch_stagehand.runtime.conductor.costs import CostModel

FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"


class HostClock:
    """The host's issue time per kind and block: from one block's wait to the next block's (the glue included),
    the last to its release. A full launch queue makes spans read high, never low: the smaller of a block's
    forward and recompute is its forward's, and several steps keep their minimum (`CostModel.refine_host`)."""

    def __init__(self, n_blocks: int):
        self.n = n_blocks
        self.marks: list[tuple[int, str, float]] = []  # (block, kind, host clock at its wait)
        self.last = 0.0  # host clock at the last release

    def mark(self, block: int, kind: str) -> None:
        self.marks.append((block, kind, time.perf_counter()))

    def release(self) -> None:
        self.last = time.perf_counter()

    def seconds(self) -> dict[str, list[float]]:
        host = {FORWARD: [0.0] * self.n, RECOMPUTE: [0.0] * self.n, BACKWARD: [0.0] * self.n}
        marks = self.marks
        for (block, kind, t), nxt in zip(marks, [m[2] for m in marks[1:]] + [self.last]):
            host[kind][block] += max(0.0, nxt - t)
        host[FORWARD] = [min(f, r) if r > 0 else f for f, r in zip(host[FORWARD], host[RECOMPUTE])]
        return host


class BlockTimer:
    """The GPU's time per kind and block: events on the compute stream after the block's wait (its copy not
    counted) and at its release (on the CPU, the host's clock). A slow host's gaps make a span read high, never
    low: the smallest measured stays (`CostModel.refine_compute`)."""

    def __init__(self, n_blocks: int, device: torch.device):
        self.n, self.device, self.cuda = n_blocks, device, device.type == "cuda"
        self._open: dict[tuple[int, str], object] = {}  # (block, kind) -> start event
        self._seen: set[tuple[int, str]] = set()
        self._spans: list[tuple[int, str, object, object]] = []
        self._kind_of_block: dict[int, str] = {}

    def event(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, start, stop) -> float:
        return stop - start if not self.cuda else start.elapsed_time(stop) / 1e3

    def open(self, block: int, kind: str) -> None:
        key = (block, kind)
        if key in self._seen:
            return  # a block split by a graph break: its first part opens the span
        self._seen.add(key)
        self._open[key] = self.event()
        self._kind_of_block[block] = kind

    def close(self, block: int) -> None:
        kind = self._kind_of_block.get(block)
        start = self._open.pop((block, kind), None) if kind is not None else None
        if start is not None:
            self._spans.append((block, kind, start, self.event()))

    def glue_seconds(self, end) -> float:
        """The GPU's time outside the blocks after the forward (read after a sync): the last forward release to the
        first backward start (the turn: head, loss, their backward), and the last release to `end` (the optimizer)."""
        spans = self._spans
        forward_ends = [stop for _, kind, _, stop in spans if kind == FORWARD]
        backward_starts = [start for _, kind, start, _ in spans if kind != FORWARD]
        if not forward_ends or not backward_starts:
            return 0.0
        return self.elapsed(forward_ends[-1], backward_starts[0]) + self.elapsed(spans[-1][3], end)

    def done(self) -> bool:
        """Have the GPU's events all been reached (a host query, never a wait)? On the CPU: always."""
        return not self.cuda or not self._spans or self._spans[-1][3].query()

    def seconds(self) -> dict[str, list[float]]:
        """Per kind and block (on CUDA, once `done()` or after the caller synchronised)."""
        seconds = {FORWARD: [0.0] * self.n, RECOMPUTE: [0.0] * self.n, BACKWARD: [0.0] * self.n}
        for block, kind, start, stop in self._spans:
            seconds[kind][block] += self.elapsed(start, stop)
        return seconds


class BlockClocks:
    """The host's and the GPU's clocks per block, opened at its wait (after its copy) and closed at its release."""

    def __init__(self, n_blocks: int, device: torch.device):
        self.host = HostClock(n_blocks)
        self.gpu = BlockTimer(n_blocks, device)

    def on_wait(self, block: int, kind: str) -> None:
        self.gpu.open(block, kind)
        self.host.mark(block, kind)

    def on_release(self, block: int) -> None:
        self.gpu.close(block)
        self.host.release()


class Calibration(BlockClocks):
    def __init__(self, n_blocks: int, device: torch.device, units: Callable[[], int] = lambda: 0):
        super().__init__(n_blocks, device)
        self.n, self.device, self.cuda = n_blocks, device, device.type == "cuda"
        self._units, self._units_at_start = units, units()  # units compiled, loaded or first run so far
        self._alloc: dict[tuple[int, str], int] = {}
        self._forward_order: list[int] = []
        self._host_in_ops = [0.0] * n_blocks  # host seconds inside schedule ops, per block of the current item
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        self._start = self.gpu.event()

    def one_time_work_in_step(self) -> bool:
        """Whether a unit compiled, loaded or first ran in the measured step (one-time seconds no plan has)."""
        return self._units() != self._units_at_start

    def on_wait(self, block: int, kind: str) -> None:
        key = (block, kind)
        if key in self._alloc:
            return  # a block split by a graph break: its first part opens the span
        self._alloc[key] = allocated_bytes(self.device)  # (0 off CUDA)
        if kind == FORWARD:
            self._forward_order.append(block)
        super().on_wait(block, kind)

    def on_schedule_op(self, seconds: float) -> None:
        """Host time spent in a schedule op, charged to the block whose item the host is issuing."""
        if self.host.marks:
            self._host_in_ops[self.host.marks[-1][0]] += seconds

    def finish(self, base: CostModel, predict: Callable[[CostModel], tuple[float, int]]) -> CostModel:
        """The measured cost model; `predict(model)` is (step s, peak bytes) of the calibration plan under it."""
        gpu = self.gpu
        end = gpu.event()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        step_s = gpu.elapsed(self._start, end)
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else 0
        seconds = gpu.seconds()
        order = self._forward_order
        inputs = [0] * self.n
        for a, b in zip(order, order[1:]):
            inputs[a] = max(0, self._alloc[(b, FORWARD)] - self._alloc[(a, FORWARD)])
        if len(order) > 1:
            inputs[order[-1]] = inputs[order[-2]]  # the last block's output goes to the glue: assume its size
        acts = [max(inputs[b], self._alloc.get((b, BACKWARD), 0) - self._alloc.get((b, RECOMPUTE), 0))
                if (b, RECOMPUTE) in self._alloc and (b, BACKWARD) in self._alloc else inputs[b]
                for b in range(self.n)]
        forward = [seconds[RECOMPUTE][b] or seconds[FORWARD][b] for b in range(self.n)]
        model = base.with_(forward_s=forward, backward_s=seconds[BACKWARD], activation_bytes=acts,
                           input_bytes=inputs, host_s=self.host.seconds(), base_bytes=0, other_s=0.0)
        totals = [sum(model.host_s[kind][b] for kind in model.host_s) for b in range(self.n)]
        model.host_fetch_share = [min(1.0, ops / total) if total > 0 else 0.0
                                  for ops, total in zip(self._host_in_ops, totals)]
        predicted_s, predicted_peak = predict(model)
        model.base_bytes = max(0, peak - predicted_peak)
        # What the step spends outside the blocks: at least the GPU's measured turn and tail (in this
        # host-bound, copy-bound step the residual can hide them, and a resident plan pays them in full).
        glue_s = gpu.glue_seconds(end)
        model.other_s = max(0.0, step_s - predicted_s, glue_s)
        model.measured = dict(base.measured, calibration_step_s=round(step_s, 4), calibration_peak_bytes=peak,
                              calibration_host_s=round(sum(map(sum, model.host_s.values())), 4),
                              calibration_glue_s=round(glue_s, 4))
        return model

