"""The one-step-delayed update (ZeRO-Offload's DPU): an option of HostAdamW that changes the math.

Step t's update runs on a thread of its own through step t+1, writing only masters and moments (resident parameters
still step exactly); the landing worker publishes a block's new weights once its gradients of step t+1 have landed,
so step t+2 first uses them. Step t+1's gradients land in a second set of buffers; `flush()` publishes the pending."""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Callable

import torch

from torch_stagehand.runtime.train.host import adamw_step


class DelayedStep:
    """`delayed_update=True`: step t's update runs beside step t+1; its weights are published block by block."""

    def _publish_block(self, block: int) -> None:
        """The block's gradients of this step landed, so its weights are read no more: publish the last update."""
        if not self.delayed.wait(block):
            return
        for p in self._trained(block):
            p.detach().copy_(self.state[p]["master"])  # an in-place write moves the version: slots refresh
        self.runtime.store.ensure_fresh(block, self.runtime.precision[block])
        self.delayed.unpublished.discard(block)

    def _step_delayed(self, scale: float) -> None:
        """Start the update from this step's gradients on the update thread; swap the gradient buffers."""
        work = {}
        for block in self._block_params:
            ps = [p for p in self._trained(block) if p.grad is not None]
            if not ps:
                continue
            grads = [p.grad if scale == 1.0 else p.grad * scale for p in ps]
            for p in ps:
                p.grad = None
            work[block] = lambda ps=ps, grads=grads: self._update_masters(ps, grads)
        self.delayed.swap_gradient_buffers(list(work))
        self.delayed.start(work)

    def _update_masters(self, ps: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        for p, g in zip(ps, grads):
            adamw_step([p], [g], [self.state[p]], self._hyper(self._group_of[p]), "fp32", self._scratch,
                       self._generator, write_weights=False)
        self.host_seconds += time.perf_counter() - t0

    def flush(self) -> None:
        """Finish the pending delayed update and publish its weights now (nothing without `delayed_update`)."""
        if self.delayed is None:
            return
        if self.worker is not None:
            self.worker.drain()
        self.delayed.join()
        for block in sorted(self.delayed.unpublished):
            self._publish_block(block)


class DelayedUpdate:
    """The update thread, the per-block "updated" events, and the second set of gradient buffers."""

    def __init__(self, lane):
        self.lane = lane
        self._thread: threading.Thread | None = None
        self._done: dict[int, threading.Event] = {}
        self.unpublished: set[int] = set()  # updated (or being updated), weights not yet written from the master
        self._error: BaseException | None = None
        self._spare: dict[int, torch.Tensor] = {}  # the other set of gradient buffers
        self.updates = 0

    def start(self, work: dict[int, Callable[[], None]]) -> None:
        """Run `work[block]()` (the update of the block's master and moments) for every block, in backward order."""
        order = sorted(work, reverse=True)
        self._done = {b: threading.Event() for b in order}
        self.unpublished = set(order)

        def run() -> None:
            for block in order:
                try:
                    if self._error is None:
                        work[block]()
                except BaseException as e:  # noqa: BLE001 - re-raised on the main thread at the next step()
                    self._error = e
                finally:
                    self._done[block].set()

        self._thread = threading.Thread(target=run, name="stagehand-delayed-adamw", daemon=True)
        self._thread.start()
        if not self.updates:  # a thread still in the fused kernel when the interpreter ends aborts the process
            atexit.register(_join_at_exit, weakref.ref(self))  # weakly: the lane and its store die with restore()
        self.updates += 1

    def wait(self, block: int) -> bool:
        """Wait for the block's pending update; False if it has none (nothing to publish)."""
        if block not in self.unpublished:
            return False
        self._done[block].wait()
        return self._error is None

    def join(self) -> None:
        """Wait for the update thread; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def swap_gradient_buffers(self, blocks: list[int]) -> None:
        """The next backward lands its gradients in the other set (this step's are the update's to read)."""
        missing = [b for b in blocks if b not in self._spare]
        if missing:  # one allocation, laid out as the lane's own
            self._spare.update(self.lane.store.grad_buffers(missing))
        for block in blocks:
            self.lane.host[block], self._spare[block] = self._spare[block], self.lane.host[block]


def _join_at_exit(ref: "weakref.ref[DelayedUpdate]") -> None:
    update = ref()
    if update is not None and update._thread is not None:
        update._thread.join()


__all__ = ["DelayedUpdate"]
