"""Device slots: a fixed set of flat device buffers, allocated once, that streamed blocks are copied into.

A slot moves FREE -> LOADING (H2D copy on the side stream, `ready` event) -> IN_USE (held by its readers; the
compute stream waits on `ready`, never the host) -> READY (released: `free` event; the bytes serve the block again)
and back to LOADING for another block once `free` passed. A held slot is never a fetch target. Resident blocks get
a slot of their own, refilled in place when their weights are written. On the CPU: synchronous copies."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from torch_stagehand.runtime.conductor.trace import (DENIED, EVICT, H2D_COPY, HIT, IN_FLIGHT, NOT_HELD, PREFETCH,
                                                     RELEASED, SYNC_FETCH, WAIT)
from torch_stagehand.runtime.host.store import HostStore

log = logging.getLogger(__name__)

ALL_SLOTS_BUSY = "all_slots_busy"  # why a prefetch was not issued: every slot is in use or loading


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    IN_USE = "in_use"
    READY = "ready"


class SlotsExhaustedError(RuntimeError):
    """A block must be made resident but every slot is held: the plan cannot be honoured."""


@dataclass
class Slot:
    index: int
    buf: torch.Tensor
    key: tuple[int, str] | None = None  # (block, precision) whose bytes the slot holds
    state: SlotState = SlotState.FREE
    nbytes: int = 0
    released_at: int = 0  # LRU tick
    ready_event: object = None
    free_event: object = None
    holds: int = 0  # readers holding the slot (compiled waits and eager reads); IN_USE while > 0
    master_version: int | None = None  # HostStore.master_version(block) when filled: a write since makes it stale
    resident: bool = False  # a resident block's own slot (index -1): never a fetch target


@dataclass
class SlotStats:
    h2d_bytes: int = 0
    fetches: int = 0  # H2D copies issued
    prefetches: int = 0  # of those, issued ahead by a prefetch
    sync_fetches: int = 0  # waits that found nothing in flight and had to fetch
    hits: int = 0  # waits/prefetches that found the block already resident
    stale_slots: int = 0  # resident copies dropped because the block's weights were written since
    denials: Counter = field(default_factory=Counter)
    resident_bytes: int = 0
    peak_resident_bytes: int = 0


class SlotPool:
    def __init__(self, device: torch.device, n_slots: int, slot_bytes: int, store: HostStore):
        self.device = torch.device(device)
        self.store, self.slot_bytes = store, slot_bytes
        self.cuda = self.device.type == "cuda"
        self.stats = SlotStats()
        self.trace = None  # a conductor ScheduleTrace while one is recorded (explain); each decision reports to it
        self._tick = itertools.count(1)
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.slots = [self._new_slot(i, slot_bytes) for i in range(n_slots)]
        self.resident_slots: dict[int, Slot] = {}  # block -> its own slot (the plan keeps it resident)

    def _new_slot(self, index: int, nbytes: int, resident: bool = False) -> Slot:
        slot = Slot(index, torch.empty(nbytes, dtype=torch.uint8, device=self.device), resident=resident)
        if self.cuda:
            slot.ready_event, slot.free_event = torch.cuda.Event(), torch.cuda.Event()
        return slot

    def all_slots(self) -> list[Slot]:
        return self.slots + list(self.resident_slots.values())

    def device_bytes(self) -> int:
        """Device bytes allocated for streamed weights: the rotating slots and the resident blocks' own."""
        return len(self.slots) * self.slot_bytes + sum(s.buf.numel() for s in self.resident_slots.values())

    def _find(self, block: int, precision: str) -> Slot | None:
        own = self.resident_slots.get(block)
        if own is not None and own.key == (block, precision):
            return own
        return next((s for s in self.slots if s.key == (block, precision)), None)

    def _find_fresh(self, block: int, precision: str) -> Slot | None:
        """The slot holding the block, unless its weights were written since the fill (the master's version counter
        moved): a stale copy nobody reads is dropped (the caller fetches afresh); one a reader holds is an error."""
        self.store.fetching()  # after a step across ranks: the owners' writes land first (train/shards.py)
        slot = self._find(block, precision)
        if slot is None or slot.master_version == self.store.master_version(block):
            return slot
        if slot.holds:
            raise RuntimeError(f"stagehand: the weights of block {block} were written while the block is being read "
                               "(between its forward and backward?); write streamed weights between calls")
        self.stats.stale_slots += 1
        if slot.resident:  # its own slot: refilled in place (the copy waits for its last reader)
            self._issue_copy(slot, block, precision)
            return slot
        self._forget(slot)
        return None

    def shadow(self) -> "SlotPool":
        """A twin on the meta device in this pool's state: plays on it move no bytes (explain's prediction)."""
        twin = SlotPool(torch.device("meta"), 0, self.slot_bytes, self.store)

        def twin_of(s: Slot) -> Slot:
            return dataclasses.replace(s, buf=torch.empty(s.buf.numel(), dtype=torch.uint8, device="meta"),
                                       ready_event=None, free_event=None)

        twin.slots = [twin_of(s) for s in self.slots]
        twin.resident_slots = {block: twin_of(s) for block, s in self.resident_slots.items()}
        twin._tick = itertools.count(max((s.released_at for s in self.all_slots()), default=0) + 1)
        twin.stats.resident_bytes = twin.stats.peak_resident_bytes = self.stats.resident_bytes
        return twin

    def cached(self, block: int, precision: str) -> bool:
        """Whether the block's bytes are in a slot (or on their way) and still fresh; changes nothing."""
        slot = self._find(block, precision)
        return slot is not None and slot.master_version == self.store.master_version(block)

    def resident(self) -> dict[int, tuple[int, str, str]]:
        """slot index -> (block, precision, state) for slots holding data."""
        return {s.index: (s.key[0], s.key[1], s.state.value) for s in self.slots if s.key is not None}

    def reconfigure(self, n_slots: int, slot_bytes: int, resident: dict[int, str]) -> None:
        """Rotating slots and resident blocks as a plan says, between steps. Slots that keep their size keep their
        bytes; resident blocks are copied in now, once."""
        held = [s.key for s in self.all_slots() if s.holds]
        if held:
            raise RuntimeError(f"stagehand: cannot re-plan while blocks {held} are being read")
        if self.cuda:
            self.copy_stream.synchronize()  # once per re-plan, never per step
            # New buffers may reuse memory the compute stream still reads: copies wait for it.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        for block in list(self.resident_slots):
            if self.resident_slots[block].key != (block, resident.get(block)):
                self._set_bytes(self.resident_slots.pop(block), 0)
        if slot_bytes != self.slot_bytes:
            for s in self.slots:
                self._set_bytes(s, 0)
            self.slots, self.slot_bytes = [], slot_bytes
        for s in self.slots[n_slots:]:
            self._set_bytes(s, 0)
        self.slots = self.slots[:n_slots] + [self._new_slot(i, slot_bytes) for i in range(len(self.slots), n_slots)]
        for block, precision in resident.items():
            if block in self.resident_slots:
                continue
            for s in self.slots:  # a rotating copy of a block that is now resident is dropped
                if s.key is not None and s.key[0] == block:
                    self._forget(s)
            own = self.resident_slots[block] = self._new_slot(-1, self.store.nbytes(block, precision), resident=True)
            self._issue_copy(own, block, precision)
            own.state = SlotState.READY

    def refresh_resident(self) -> int:
        """Copy in now, between steps, every resident block whose weights were written since; returns how many."""
        stale = [(b, s) for b, s in self.resident_slots.items()
                 if s.key is not None and not s.holds and s.master_version != self.store.master_version(b)]
        for block, slot in stale:
            self._find_fresh(block, slot.key[1])  # a stale resident copy is refilled in place, and counted
        return len(stale)

    def _victim(self, steal_loading: bool = False) -> Slot | None:
        """A free slot, else the least recently released; `steal_loading` (a block must be resident now) also takes
        one whose prefetch nobody waited on yet (its copy is ordered before ours on the copy stream, unread)."""
        free = [s for s in self.slots if s.state is SlotState.FREE]
        if free:
            return free[0]
        ready = [s for s in self.slots if s.state is SlotState.READY]
        if ready:
            return min(ready, key=lambda s: s.released_at)
        loading = [s for s in self.slots if s.state is SlotState.LOADING] if steal_loading else []
        return min(loading, key=lambda s: s.released_at) if loading else None

    def _issue_copy(self, slot: Slot, block: int, precision: str) -> None:
        self.store.fetching()
        self.store.ensure_fresh(block, precision)
        slot.master_version = self.store.master_version(block)
        src = self.store.buffer(block, precision)
        n = src.numel()
        if n > slot.buf.numel():
            raise RuntimeError(f"block {block} ({precision}) needs {n} bytes but its slot holds {slot.buf.numel()}")
        if self.cuda:
            # After the slot's last reader (a new slot's unrecorded event is a no-op wait).
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(slot.free_event)
                slot.buf[:n].copy_(src, non_blocking=True)
                slot.ready_event.record(self.copy_stream)
        else:
            slot.buf[:n].copy_(src)
        self.store.copied(block, precision, self.copy_stream)  # a disk tier's staging may go
        self._set_bytes(slot, n)
        slot.key, slot.state = (block, precision), SlotState.LOADING
        slot.released_at = next(self._tick)
        self.stats.h2d_bytes += n
        self.stats.fetches += 1

    def _set_bytes(self, slot: Slot, n: int) -> None:
        self.stats.resident_bytes += n - slot.nbytes
        slot.nbytes = n
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.stats.resident_bytes)

    def prefetch(self, block: int, precision: str) -> bool:
        """Start copying a block in, if a slot is free; never blocks the host. True: an H2D copy was started."""
        slot = self._find_fresh(block, precision)
        if slot is not None:
            self.stats.hits += 1
            self._record(PREFETCH, block, precision, slot.index, slot.nbytes, HIT)
            return False
        victim = self._victim()
        if victim is None:
            self.stats.denials[ALL_SLOTS_BUSY] += 1
            self._record(PREFETCH, block, precision, None, self.store.nbytes(block, precision), DENIED, ALL_SLOTS_BUSY)
            return False
        self._issue_copy(victim, block, precision)
        self.stats.prefetches += 1
        self._record(PREFETCH, block, precision, victim.index, victim.nbytes, H2D_COPY)
        return True

    def _record(self, *row) -> None:
        if self.trace is not None:
            self.trace.record(*row)

    def acquire(self, block: int, precision: str, reader: str = WAIT) -> torch.Tensor:
        """Make the block resident and readable on the current stream, and hold it until `release` (holds count);
        returns its bytes. `reader` labels the trace row (WAIT or EAGER)."""
        slot = self._find_fresh(block, precision)
        if slot is None:
            victim = self._victim(steal_loading=True)
            if victim is None and not self.slots:
                # Every block is resident, but this one is asked for in another precision: one slot, said once.
                log.warning("stagehand: block %d asked for in %s, not its resident precision: adding a slot",
                            block, precision)
                self.slot_bytes = max(self.slot_bytes, self.store.nbytes(block, precision))
                self.slots.append(victim := self._new_slot(0, self.slot_bytes))
                if self.cuda:  # its memory may be what a queued kernel still reads
                    self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            if victim is None:
                held = {s.index: s.key for s in self.slots}
                raise SlotsExhaustedError(f"stagehand: block {block} ({precision}) must be resident but all "
                                          f"{len(self.slots)} slots are in use (slot -> (block, precision): {held}); "
                                          "raise Config.slots")
            self._issue_copy(victim, block, precision)
            self.stats.sync_fetches += 1
            slot = victim
            self._record(reader, block, precision, slot.index, slot.nbytes, SYNC_FETCH)
        else:
            self.stats.hits += slot.state is not SlotState.LOADING
            self._record(reader, block, precision, slot.index, slot.nbytes,
                         IN_FLIGHT if slot.state is SlotState.LOADING else HIT)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(slot.ready_event)
        slot.holds += 1
        slot.state = SlotState.IN_USE
        return slot.buf[: slot.nbytes]

    def release(self, block: int, precision: str) -> None:
        """Drop one hold; the last one records the free event after every queued reader."""
        slot = self._find(block, precision)
        if slot is None or slot.holds == 0:
            self._record(EVICT, block, precision, None if slot is None else slot.index, 0, NOT_HELD)
            return  # already released (a block split by a graph break releases once per part)
        self._record(EVICT, block, precision, slot.index, slot.nbytes, RELEASED)
        slot.holds -= 1
        if slot.holds:
            return
        if self.cuda:
            slot.free_event.record(torch.cuda.current_stream(self.device))
        slot.state = SlotState.READY
        slot.released_at = next(self._tick)

    def release_all(self) -> None:
        """Drop every hold (a compiled block raised before its evict ran)."""
        for s in self.all_slots():
            while s.holds:
                self.release(*s.key)

    def invalidate(self, block: int | None = None) -> None:
        """Forget cached copies (after the host master changed). Held slots are an error."""
        for s in self.all_slots():
            if s.key is not None and (block is None or s.key[0] == block):
                if s.state is SlotState.IN_USE:
                    raise RuntimeError(f"stagehand: block {s.key[0]} is in use; cannot invalidate its slot")
                if s.resident:
                    s.master_version = None  # refilled in place at the next wait
                else:
                    self._forget(s)

    def _forget(self, s: Slot) -> None:
        """Drop a slot's copy (nobody holds it); the next fetch into it waits for any copy in flight."""
        if self.cuda and s.state is SlotState.LOADING:
            s.free_event.record(self.copy_stream)
        self._set_bytes(s, 0)
        s.key, s.state = None, SlotState.FREE
