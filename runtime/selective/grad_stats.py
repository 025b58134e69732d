"""Per-block gradient statistics, accumulated on the device and read by the host once per update.

`collect()` (after each backward) reduces each block's trainable gradients to sum of squares, max |g|, sum and
count in row `step % window` of a device ring, as queued device work only; `read()` copies the ring to the host once
per update and averages the window: L2 norm, max |g|, variance, and L2 relative to the mean over blocks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

_SUMSQ, _MAXABS, _SUM, _COUNT = range(4)


@dataclass
class WindowStats:
    """Window averages per block (host floats)."""

    l2: list[float]
    max_abs: list[float]
    variance: list[float]
    rel_magnitude: list[float]  # l2 / mean of l2 over blocks (0 when every block's gradient is 0)
    steps: int  # backward passes in the window


class BlockGradStats:
    def __init__(self, params_per_block: list[list[torch.Tensor]], window: int, device: torch.device):
        self.params = [list(ps) for ps in params_per_block]
        self.n_blocks = len(self.params)
        self.window = window
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as the gradients name it: "cuda:0"
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.ring = torch.zeros(window, self.n_blocks, 4, dtype=torch.float32, device=self.device)
        self.steps = 0  # collect() calls
        self.host_reads = 0  # read() calls: the only device -> host copies
        self._index_cache: dict[tuple, torch.Tensor] = {}

    def collect(self) -> None:
        """Reduce this backward's gradients into the ring. Queues device work only."""
        # One read of each .grad: under full fine-tuning the optimizer's worker may clear them meanwhile.
        landed = [(b, g) for b, params in enumerate(self.params) for g in (p.grad for p in params) if g is not None]
        landed.sort(key=lambda bg: str(bg[1].device))  # one run per device (stable: the same order every step)
        owners, grads = [b for b, _ in landed], [g for _, g in landed]
        row = torch.zeros(self.n_blocks, 4, dtype=torch.float32, device=self.device)
        if grads:
            # The set of parameters with a gradient is the same every step in practice: one copy, cached.
            index = self._index_cache.get(tuple(owners))
            if index is None:
                index = self._index_cache[tuple(owners)] = torch.tensor(owners, dtype=torch.int64).to(self.device)
            norms, maxes, sums = self._reduce(grads)
            counts = torch.tensor([g.numel() for g in grads], dtype=torch.float32).to(self.device, non_blocking=True)
            row[:, _SUMSQ].index_add_(0, index, norms.square())
            row[:, _MAXABS].scatter_reduce_(0, index, maxes, reduce="amax")
            row[:, _SUM].index_add_(0, index, sums)
            row[:, _COUNT].index_add_(0, index, counts)
        self.ring[self.steps % self.window].copy_(row)
        self.steps += 1

    def _reduce(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each gradient's L2 norm, max |g| and sum, in order, on the ring's device. `grads` come in one run per
        device: gradients on another one (full fine-tuning: the streamed weights' land on the host) are reduced
        where they are and the three floats each come over."""
        parts = []
        for device, run in itertools.groupby(grads, key=lambda g: g.device):
            group = list(run)
            reduced = torch.stack([torch.stack(torch._foreach_norm(group, 2)).float(),
                                   torch.stack(torch._foreach_norm(group, float("inf"))).float(),
                                   torch.stack([g.sum() for g in group]).float()])
            parts.append(reduced if device == self.device else reduced.to(self.device))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out[0], out[1], out[2]

    def read(self) -> WindowStats:
        """The window's averages; one device -> host copy."""
        filled = min(self.steps, self.window)
        if filled == 0:
            raise RuntimeError("selective precision: no gradient statistics collected yet")
        self.host_reads += 1
        ring = self.ring[:filled].double().cpu()  # the one read per update
        count = ring[..., _COUNT].clamp_min(1.0)
        l2 = ring[..., _SUMSQ].sqrt().mean(0)
        mean = ring[..., _SUM] / count
        variance = (ring[..., _SUMSQ] / count - mean.square()).clamp_min(0.0).mean(0)
        max_abs = ring[..., _MAXABS].mean(0)
        average = l2.mean()
        rel = l2 / average if average > 0 else torch.zeros_like(l2)
        return WindowStats(l2.tolist(), max_abs.tolist(), variance.tolist(), rel.tolist(), filled)
