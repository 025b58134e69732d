"""The eager op path: a streamed layer read by an op that no compiled block scheduled.

Two ways, chosen per call:

* **Through the block's slot**: the op acquires its block's slot (copying the whole block if it is not there),
  computes, releases it; the first layer of a block prefetches the block that ran after it last time.
* **Direct reads, routed experts only** (`Config.routed_experts_max_tokens`): a forward with no grad over a few
  tokens (generation) of a mixture-of-experts model, whose router picks a few experts of each block. Each Linear
  copies only its own rows, on the compute stream, into a device buffer kept per size; each expert stack gets the
  rows of the routed experts from the expert cache (experts/cache.py), gathered into a dense stack buffer, where
  the cost model says the routed copies beat one copy of the block. The host waits once per experts module and
  forward for the router's choice. A block the slot pool holds already is read from its slot. The rows of experts
  not routed to are stale in the stack buffer; no experts implementation reads them.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch

from torch_stagehand.runtime.blocks import check_not_wrapped_off_device
from torch_stagehand.runtime.conductor.trace import EAGER
from torch_stagehand.runtime.experts.cache import ExpertCache
from torch_stagehand.runtime.ops import grad_input_from_slot, linear_from_slot
from torch_stagehand.runtime.precision import LayerLayout
from torch_stagehand.runtime.train.ddp import check_not_sharded


class EagerFallbackWarning(UserWarning):
    """A compiled model ran a block through the eager op path (correct, slower)."""


def warn_eager_once(warned: set, block: int, block_name: str, backward: bool) -> None:
    """Warn that `block` ran eagerly inside a compiled model, once per (block, cause) in `warned`."""
    cause = ("recomputed in backward outside the compiled program (reentrant checkpointing, or a checkpoint "
             "the backend could not place)" if backward else
             "ran outside the compiled program (a graph the backend did not get, or Dynamo fell back to eager)")
    if (block, cause) not in warned:
        warned.add((block, cause))
        warnings.warn(f"stagehand: block {block_name} {cause}: its streamed linears run the eager op "
                      "path, one op at a time (correct, slower; counted in stats()['eager_linear_calls'])",
                      EagerFallbackWarning, stacklevel=5)


# A module's forward memo (experts/stacks.py) holds its stacks by name, and these: the router's choice, the module's
# hidden states (the next router's input for the guess) and the guess, until the prefetch is issued.
_PICKED, _HIDDEN, _GUESS = ("picked",), ("hidden",), ("guess",)


class EagerPath:
    def __init__(self, layers, store, pool, plan_driver, fetch_order, phases, cache: ExpertCache, *,
                 first_layer: dict[int, int], layer_slots: list, block_names: list[str], device: torch.device,
                 precision: Callable[[], dict[int, str]], forward_ran: Callable[[], None],
                 check_open: Callable[[], None], graph_records: list, max_routed_tokens: int):
        """`first_layer`: block -> its first layer's index in `layers`; `precision()`: the map now (read);
        `check_open()` raises once the runtime is closed; `graph_records`: the backend's (none: not compiled)."""
        self.layers, self.store, self.pool, self.plan_driver, self.phases = layers, store, pool, plan_driver, phases
        self.fetch_order, self.cache, self.first_layer, self.layer_slots = fetch_order, cache, first_layer, layer_slots
        self.block_names, self.device, self.precision, self.forward_ran = block_names, device, precision, forward_ran
        self.check_open, self.graph_records = check_open, graph_records
        self.max_routed_tokens = max_routed_tokens if any(s.experts for s in layers) else 0
        self._buffers: dict[tuple, torch.Tensor] = {}  # (what, shape, dtype) -> a device buffer reused
        self.direct_reads = 0
        self.whole_stacks = 0  # direct-read calls whose router picked too many experts: the block came whole
        self.linear_calls = 0  # calls of a streamed layer through this path (stats()["eager_linear_calls"])
        self.blocks_taken: set[int] = set()  # the blocks they belong to (stats()["eager_blocks"])
        self.warned: set[tuple[int, str]] = set()  # (block, cause) already told (warn_eager_once)

    def linear(self, index: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        backward = self._phase()
        if not backward:
            self.forward_ran()
        spec = self.layers[index]
        if self._direct(spec.block, x.numel() // max(spec.in_features, 1)):
            self.count(spec.block, backward)
            slot, lay = self._layer_rows(index)
            return linear_from_slot(x, slot, bias, lay.as_ints())
        with self.slot(index, backward) as (slot, layout):
            return linear_from_slot(x, slot, bias, layout)

    def grad_input(self, index: int, dy: torch.Tensor) -> torch.Tensor:
        self.phases.backward_op()
        with self.slot(index, backward=True) as (slot, layout):
            return grad_input_from_slot(dy, slot, layout)

    def stack(self, index: int, dtype: torch.dtype, routed: torch.Tensor | None,
              forward_memo: dict | None = None) -> torch.Tensor:
        """An expert stack on the device in the module's shape; `routed`: the experts' indices the router
        picked for this call (any shape), when the experts module saw them; `forward_memo`: what the module
        keeps for one forward (experts/stacks.py), where the router's choice is read once for all its stacks."""
        from torch_stagehand.runtime.experts.stacks import dense_from_slot

        backward = self._phase()
        spec = self.layers[index]
        tokens = routed.numel() // routed.shape[-1] if routed is not None and routed.dim() > 1 else None
        if routed is not None and self._direct(spec.block, routed.numel() if tokens is None else tokens):
            memo = forward_memo if forward_memo is not None else {}
            picked = [e for e in self._picked(spec.block, routed, memo) if 0 <= e < spec.experts]
            # Copying the missing experts one by one pays while they are few; else the whole block at once.
            top_k = routed.shape[-1] if routed.dim() > 1 else 1
            if memo.setdefault(("routed", spec.block), self.cache.worth_routing(spec.block, picked, top_k)):
                self.count(spec.block, backward)
                out = self._buffer(("stack", index - self.first_layer[spec.block]), spec.weight.numel(),
                                   dtype).view(spec.weight.shape)
                self.cache.read(index, picked, dtype, out, memo)
                self.direct_reads += 1
                guess = memo.pop(_GUESS, None)
                # once a forward, after this block's first gather was issued; not for a block that is read
                # another way (held in a slot, or read from the slab on disk)
                if guess is not None and self._direct(guess[0], 0):
                    self.cache.prefetch(guess[0], guess[1], (spec.block, picked))
                return out
            self.whole_stacks += 1
        with self.slot(index, backward) as (slot, layout):
            w = dense_from_slot(slot, LayerLayout.from_ints(layout), dtype)
            w = w.clone() if w.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr() else w
            return w.view(spec.weight.shape)

    def _phase(self) -> bool:
        """Note the op's phase; True in backward (a forward there is a checkpointed block's recompute)."""
        backward = torch._C._current_graph_task_id() != -1
        (self.phases.backward_op if backward else self.phases.forward_op)()
        return backward

    @contextlib.contextmanager
    def slot(self, index: int, backward: bool):
        """The layer's block, held for the one op that reads it (then released)."""
        self.check_open()
        block = self.layers[index].block
        precision = self.precision()[block]
        self.count(block, backward)
        slot = self.pool.acquire(block, precision, reader=EAGER)
        try:
            first = self.first_layer[block]
            if first == index:
                end = index + len(self.store.blocks[block].layers)
                for i in range(index, end):
                    check_not_wrapped_off_device(self.layers[i], self.layer_slots[i], self.device)
                check_not_sharded(self.layers[index:end])
                # No schedule: fetch the block that runs next (in the order the blocks ran, reversed in backward);
                # the slot just acquired is held, so this prefetch can never overwrite it.
                if not backward:
                    self.fetch_order.record_forward(block)
                self.plan_driver.prefetch(self.fetch_order.eager_next(block, backward))
            yield slot, self.store.layout(block, precision)[index - first].as_ints()
        finally:
            self.pool.release(block, precision)

    def count(self, block: int, backward: bool) -> None:
        """The eager op path is correct but slow: count it, and say once per cause when a compiled model took it."""
        self.linear_calls += 1
        self.blocks_taken.add(block)
        if self.graph_records:  # else the model is simply being called without torch.compile
            warn_eager_once(self.warned, block, self.block_names[block], backward)

    def _direct(self, block: int, tokens: int) -> bool:
        """Read this call's layers directly: no grad, few tokens, a MoE model, a block not held in a slot."""
        if not self.max_routed_tokens or tokens > self.max_routed_tokens or torch.is_grad_enabled():
            return False
        precision = self.precision()[block]
        return (block, precision) not in self.store.on_disk and not self.pool.cached(block, precision)

    def _picked(self, block: int, routed: torch.Tensor, memo: dict) -> list[int]:
        """The experts the router picked, on the host: the path's one wait, once per module and forward. The
        next MoE block's router, applied to this block's hidden states on the device first, is read in the
        same transfer: its guess is what `ExpertCache.prefetch` copies while this block computes."""
        if _PICKED in memo:
            return memo[_PICKED]
        chosen = torch.unique(routed.reshape(-1))
        guess = self.cache.router_guess(block, memo.get(_HIDDEN), routed.shape[-1] if routed.dim() > 1 else 1)
        if guess is None:
            picked = chosen.tolist()  # a device-to-host read: waits for the router
        else:  # unique's size is known on the host (it waited for it): it says where the guess starts
            both = torch.cat([chosen, guess[1].to(chosen.dtype)]).tolist()
            cut = chosen.numel()
            picked, memo[_GUESS] = both[:cut], (guess[0], list(dict.fromkeys(both[cut:])))
        memo[_PICKED] = picked
        return picked

    def _buffer(self, what, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (what, numel, dtype)
        if key not in self._buffers:
            with torch.inference_mode(False):  # made under inference_mode, it could not be written outside it
                self._buffers[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return self._buffers[key]

    def release(self) -> None:
        """Drop the device buffers (the Runtime closes)."""
        self._buffers.clear()
        self.cache.release()

    def _layer_rows(self, index: int) -> tuple[torch.Tensor, LayerLayout]:
        """One Linear's bytes (weight and scale) copied into a device buffer, and its layout there."""
        spec, store = self.layers[index], self.store
        block, precision = spec.block, self.precision()[spec.block]
        store.fetching()
        store.ensure_fresh(block, precision)
        host, lay = store.buffer(block, precision), store.layout(block, precision)[index - self.first_layer[block]]
        end = (lay.scale_offset + 4 * lay.out_features if lay.scale_offset >= 0
               else lay.offset + lay.out_features * lay.in_features * lay.dtype.itemsize)
        buf = self._buffer("linear", end - lay.offset, torch.uint8)
        buf.copy_(host[lay.offset:end], non_blocking=host.is_pinned())  # on the compute stream: ordered with the math
        self.pool.stats.h2d_bytes += end - lay.offset
        self.direct_reads += 1
        moved = LayerLayout(lay.code, 0, lay.out_features, lay.in_features,
                            lay.scale_offset - lay.offset if lay.scale_offset >= 0 else -1, lay.transposed,
                            lay.dtype_code)
        return buf, moved
