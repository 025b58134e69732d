"""HostAdamW's one-step-delayed update (runtime/train/delayed.py says what it changes and how).

A mixin of `HostAdamW` (train/optimizer.py): the update thread's work, the
publishing of a block's weights by the landing worker, and `flush`.
"""

from __future__ import annotations

import time

import torch

from torch_stagehand.runtime.train.host import adamw_step


class DelayedStep:
    """`delayed_update=True`: step t's update runs beside step t+1; its weights are published block by block."""

    def _publish_block(self, block: int) -> None:
        """The block's gradients of this step have landed (the landing worker): its weights are no longer read
        in this step, so the previous step's update is written into them, rounded from the master."""
        if not self.delayed.wait(block):
            return
        for p in self._trained(block):
            p.detach().copy_(self.state[p]["master"])  # an in-place write moves the version: slots refresh
        self.runtime.store.ensure_fresh(block, self.runtime.precision[block])
        self.delayed.published(block)

    def _step_delayed(self, scale: float) -> None:
        """Start the update from this step's gradients on the update thread; the next backward lands in the
        other gradient buffers and publishes it block by block."""
        work, blocks = {}, []
        for block in self._block_params:
            ps = [p for p in self._trained(block) if p.grad is not None]
            if not ps:
                continue
            grads = [p.grad if scale == 1.0 else p.grad * scale for p in ps]
            for p in ps:
                p.grad = None
            work[block] = lambda ps=ps, grads=grads: self._update_masters(ps, grads)
            blocks.append(block)
        self.delayed.swap_gradient_buffers(blocks)
        self.delayed.start(work)

    def _update_masters(self, ps: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        for p, g in zip(ps, grads):
            adamw_step([p], [g], [self.state[p]], self._hyper(self._group_of[p]), "fp32", self._scratch,
                       self._generator, write_weights=False)
        self.host_seconds += time.perf_counter() - t0

    def flush(self) -> None:
        """The delayed update: finish the pending update and write its weights now (a checkpoint then holds the
        weights its masters say). Nothing to do without `delayed_update`."""
        if self.delayed is None:
            return
        if self.worker is not None:
            self.worker.drain()
        self.delayed.join()
        for block in sorted(self.delayed.unpublished):
            self._publish_block(block)

