"""The one-step-delayed update (DeepSpeed ZeRO-Offload's DPU): an option of HostAdamW that changes the math.

The exact path steps a block on the host as its gradients land, overlapped with
the backward of the blocks before it; the optimizer's work past the end of the
backward is the step's tail. Here the update computed from step t's gradients
runs on a thread of its own through all of step t+1 (its forward and its
backward), and the weights it produces are first used by step t+2: every
streamed weight trains one step late. Resident parameters (embeddings, norms,
heads, LoRA) still step exactly, in `step()`.

How it stays consistent:
- The update writes only the fp32 master and the moments (every weight keeps
  a master of its own), never the weights that step t+1 is reading.
- A block's new weights are *published* (rounded from its master, its version
  moved so slots and INT8 / FP8 copies refresh) when its gradients of step t+1
  have landed: the GPU is done reading its weights for step t+1 then, and step
  t+2's forward fetches the new ones. The landing worker publishes, after
  waiting for the block's update (blocks are updated in backward order, the
  order the next backward lands them).
- Step t's gradients are read by the update while step t+1's land: two sets of
  host gradient buffers, swapped at each `step()`.
- `flush()` finishes the pending update and publishes it now (a checkpoint
  then holds the weights the masters say; the next step runs on them).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Callable

import torch


class DelayedUpdate:
    """The update thread, the per-block "updated" events, and the second set of gradient buffers."""

    def __init__(self, lane):
        self.lane = lane
        self._thread: threading.Thread | None = None
        self._done: dict[int, threading.Event] = {}
        self.unpublished: set[int] = set()  # updated (or being updated), weights not yet written from the master
        self._error: BaseException | None = None
        self._spare: dict[int, torch.Tensor] | None = None
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

    def published(self, block: int) -> None:
        self.unpublished.discard(block)

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
        if self._spare is None:
            self._spare = {}
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
