"""The host store: the master copy of every streamed weight, one flat buffer per block per precision.

The modules' weights become views of a block's full-precision buffer (so `state_dict()` is real); every other
precision's buffer is derived from it (or read from a slab), and streaming only reads them. A copy kind's buffers
are views of one allocation (`host/arena.py`); only what streams stays page-locked. A master copied up to be
quantized on the GPU is locked while its block is built (the copy at the link's speed);
copies down into the store go through the pinned bounce buffer (`host/copy.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.blocks import StreamedLayerSpec
from torch_stagehand.runtime.host import copy as host_copy
from torch_stagehand.runtime.host.arena import HostArena, NoPinner, PinError, lock_or_fall_back
from torch_stagehand.runtime.host.node_store import NodeStoreError
from torch_stagehand.runtime.precision import LayerLayout


@dataclass
class BlockBuffers:
    """One block's host copies: a flat buffer per precision, its layout, the master version each was built from."""

    layers: list[StreamedLayerSpec]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # precision name -> flat uint8 buffer
    layouts: dict[str, list[LayerLayout]] = field(default_factory=dict)
    # The master's version counter when a derived buffer was built (a later in-place write makes it stale);
    # None: not built from the master (read from a slab).
    source_versions: dict[str, int | None] = field(default_factory=dict)
    # keep_full="file": the layers' weights as views of the safetensors file, the master.
    file_master: list[torch.Tensor] | None = None

    @property
    def full(self) -> torch.Tensor | None:
        """The flat full-precision buffer (the master, unless the master is in the file; None if absent)."""
        return self.buffers.get(precisions.FULL)

    @property
    def has_master(self) -> bool:
        return self.file_master is not None or self.full is not None


log = logging.getLogger(__name__)

# Where a block's full-precision master is kept (Config.keep_full / offload(keep_full=...)).
KEEP_PINNED, KEEP_RAM, KEEP_FILE = "pinned", "ram", "file"


class HostStore:
    def __init__(self, layers: list[StreamedLayerSpec], n_blocks: int, pin: bool, quantizer: str, quant_device=None,
                 pinner=None, keep_full: str = KEEP_PINNED, node=None):
        self.pin = pin
        self.node = node  # the node's shared store (host/node_store.py), or None
        self.pinner = pinner if pinner is not None else NoPinner()
        self.keep_full = keep_full
        self.quantizer = quantizer
        self.quant_device = quant_device  # where derived copies are quantized (the GPU: seconds, not minutes)
        self.blocks = [BlockBuffers(layers=[s for s in layers if s.block == b]) for b in range(n_blocks)]
        self.requantized_blocks = 0  # derived copies rebuilt because their master was written since
        self.arenas: list[HostArena] = []
        self.after_file_read: Callable[[], None] | None = None  # keep_full="file": drop the mapped pages read
        self.disk_tier = None  # Config(int8_tier="disk"): the copies in on_disk are read at each fetch
        self.on_disk: set[tuple[int, str]] = set()
        self._reserved: dict[tuple[int, str], torch.Tensor] = {}  # carved, not yet handed out
        self._arena_of: dict[tuple[int, str], HostArena] = {}
        self.offloaded = False  # offload is done: a refused page-lock falls back to pageable (host/arena.py)
        # Told when a module's weight was replaced by a view of the store (host/undo.py keeps the original).
        self.on_replaced: Callable[[StreamedLayerSpec, torch.Tensor], None] | None = None
        self.before_fetch: Callable[[], None] | None = None  # run once at the next fetch (train/shards.py)
        # A slab's rows still read after offload returned (read_process.RowsBehind): a fetch waits for them.
        self.rows_behind = None

    def _new_arena(self, kind: str, sizes: list[int], shareable: bool = True, backing=None) -> HostArena:
        """`shareable`: the node's ranks may share it while offload runs (a rank's gradients are its own)."""
        shared = self.node if shareable and self.node is not None and not self.node.done else None
        return HostArena(kind, sizes, self.pinner, shared=shared, backing=backing)

    def writes(self, block: int, precision: str) -> bool:
        """Whether this process fills the block's buffer (False: another rank of the node does, host/node_store.py)."""
        arena = self._arena_of.get((block, precision))
        return arena is None or not arena.shared or self.node.owns(block)

    def reserve(self, precision: str, blocks: list[int], backing=None) -> None:
        """One host allocation for the precision's buffers of `blocks` (those not held yet); `backing`: HostArena's."""
        blocks = [b for b in blocks if not self.has(b, precision) and (b, precision) not in self._reserved]
        if not blocks:
            return
        sizes = [self.nbytes(b, precision) for b in blocks]
        kind = f"{precision} {'master' if self._is_master(blocks[0], precision) else 'copy'}"
        try:
            arena = self._new_arena(kind, sizes, backing=backing)
        except NodeStoreError:
            raise  # another rank of the node failed: its own message
        except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:  # say what did not fit
            raise torch.OutOfMemoryError(
                f"offload: no host memory for the {precision} copies of blocks {blocks[0]}..{blocks[-1]} "
                f"({sum(sizes) / 2**20:.1f} MiB, first layer {self.blocks[blocks[0]].layers[0].fqn}): {e}") from e
        self.arenas.append(arena)
        for b, n in zip(blocks, sizes):
            self._reserved[(b, precision)] = arena.carve(n)
            self._arena_of[(b, precision)] = arena

    def grad_buffers(self, blocks: list[int]) -> dict[int, torch.Tensor]:
        """Host gradient buffers for blocks whose weights train (train/grads.py): each the size and layout of
        the block's master, one allocation, page-locked where the store pins (the D2H copies land there)."""
        sizes = [precisions.master().layout(self.blocks[b].layers)[1] for b in blocks]
        try:
            arena = self._new_arena("grad", sizes, shareable=False)
        except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
            raise torch.OutOfMemoryError(f"stagehand: no host memory for the gradients of blocks {blocks} "
                                         f"({sum(sizes) / 2**20:.1f} MiB): {e}") from e
        self.arenas.append(arena)
        out = {}
        for block, n in zip(blocks, sizes):
            out[block] = arena.carve(n)
            if self.pin:
                lock_or_fall_back(arena, out[block], f"block {block}'s gradient buffer", refuse=not self.offloaded)
        return out

    def _is_master(self, block: int, precision: str) -> bool:
        return precision == precisions.FULL and self.blocks[block].file_master is None

    def set_pins(self, precision_map: dict[int, str]) -> None:
        """Lock exactly what streams (plus every master under keep_full="pinned"), unlock the rest. A flat
        full-precision copy derived from a file master is dropped when its block stops streaming it."""
        if self.rows_behind is not None and self.offloaded:  # a new map after offload: every row in first
            self.rows_behind.wait()
        unlock = []  # (arena, buffer): unlocked together after one drain of the copies in flight
        for block, bb in enumerate(self.blocks):
            streams = precision_map.get(block)
            if bb.file_master is not None and streams != precisions.FULL and precisions.FULL in bb.buffers:
                self._drop(block, precisions.FULL)
            for precision, buf in bb.buffers.items():
                arena = self._arena_of.get((block, precision))
                if arena is None:
                    continue
                if not self._stays_locked(block, precision, streams):
                    if arena.is_locked(buf):
                        unlock.append((arena, buf))
                elif precision != precisions.INT8 or self.rows_behind is None or not self.rows_behind.waiting(block):
                    self._lock(block, precision, arena)
        if unlock:
            unlock[0][0].pinner.drain()
            for arena, buf in unlock:
                arena.unlock(buf, drained=True)

    def lock_filled(self, block: int, precision: str, refuse: bool | None = None) -> None:
        """Page-lock a copy as soon as its bytes are in (a slab's reads; any thread); `set_pins` decides later.
        `refuse`: a refused lock fails offload (default: until offload is done); False: it stays pageable."""
        arena = self._arena_of.get((block, precision))
        if self.pin and arena is not None and not arena.shared:
            self._lock(block, precision, arena, refuse)

    def _stays_locked(self, block: int, precision: str, streams: str | None) -> bool:
        """Whether the block's `precision` buffer is page-locked while the block streams `streams`: what streams,
        and every master under keep_full="pinned"."""
        return self.pin and (precision == streams or (self.keep_full == KEEP_PINNED
                                                      and self._is_master(block, precision)))

    def _lock_for_copy(self, block: int, precision: str) -> bool:
        """Page-lock a filled buffer a GPU copy is about to read, so that it runs at the link's speed; True when
        this call locked it (the caller unlocks it after). Only a filled one: locking commits pages one by one,
        slower than the copies that fault them in. A refusal leaves it pageable: the copy is staged by the
        driver, the same bytes, slower."""
        arena = self._arena_of.get((block, precision))
        view = self.blocks[block].buffers.get(precision)
        if not self.pin or arena is None or arena.shared or view is None or arena.is_locked(view):
            return False
        try:
            arena.lock(view)
            return True
        except PinError as e:
            log.debug("stagehand: block %d's %s buffer copies pageable: %s", block, precision, e)
            return False

    def _lock(self, block: int, precision: str, arena: HostArena, refuse: bool | None = None) -> None:
        bb = self.blocks[block]
        lock_or_fall_back(arena, bb.buffers[precision], f"block {block}'s {precision} copy (first layer "
                          f"{bb.layers[0].fqn})", refuse=not self.offloaded if refuse is None else refuse)

    def _drop(self, block: int, precision: str) -> None:
        bb = self.blocks[block]
        arena = self._arena_of.pop((block, precision), None)
        if arena is not None:
            arena.unlock(bb.buffers[precision])
            if all(a is not arena for a in self._arena_of.values()):
                self.arenas.remove(arena)
        del bb.buffers[precision], bb.layouts[precision]
        bb.source_versions.pop(precision, None)

    def free(self) -> None:
        """Unlock and drop every buffer (restore / close): the memory goes back when the views die."""
        if self.rows_behind is not None:  # no reader writes into pages that go
            self.rows_behind.cancel()
        if self.disk_tier is not None:
            self.disk_tier.close()
            self.disk_tier = None
        for arena in self.arenas:
            arena.close()
        for held in (self.on_disk, self.arenas, self._reserved, self._arena_of):
            held.clear()
        for bb in self.blocks:
            for held in (bb.buffers, bb.layouts, bb.source_versions):
                held.clear()
            bb.file_master = None

    def adopt_full(self, block: int, source: Callable[[StreamedLayerSpec], torch.Tensor | None]) -> bool:
        """Move the block's weights into one flat buffer; the modules keep views of it. `source(spec)`: a layer's
        weight in the module's layout. False (nothing kept) when there are no weights."""
        bb = self.blocks[block]
        weights = [source(spec) for spec in bb.layers]
        if any(w is None or w.is_meta for w in weights):
            return False
        entry = precisions.master()
        buf = self.allocate(block, entry.name)
        for spec, lay, w in zip(bb.layers, bb.layouts[entry.name], weights):
            if self.writes(block, entry.name):
                with torch.no_grad():
                    entry.write(buf, lay, spec.as_matrix(w), self.quantizer)
            # A Parameter of its own on the buffer (sharing its version counter); the original's memory goes.
            self._replace(spec, spec.stored_view(entry.views(buf, lay)[0]))
        return True

    def _replace(self, spec: StreamedLayerSpec, view: torch.Tensor) -> None:
        original = spec.module._parameters[spec.param]
        spec.module._parameters[spec.param] = torch.nn.Parameter(view, requires_grad=original.requires_grad)
        if self.on_replaced is not None:
            self.on_replaced(spec, original)

    def adopt_file(self, block: int, views: list[torch.Tensor]) -> None:
        """keep_full="file": the layers' weights become views of the mapped safetensors file."""
        bb = self.blocks[block]
        for spec, view in zip(bb.layers, views):
            self._replace(spec, view)
        bb.file_master = [spec.module._parameters[spec.param] for spec in bb.layers]

    def allocate(self, block: int, precision: str) -> torch.Tensor:
        """An empty buffer in the precision's layout (filled by `build` or a slab reader)."""
        bb = self.blocks[block]
        if (block, precision) not in self._reserved:
            self.reserve(precision, [block])
        buf = self._reserved.pop((block, precision))
        bb.buffers[precision], bb.layouts[precision] = buf, precisions.get(precision).layout(bb.layers)[0]
        return buf

    def build(self, block: int, precision: str) -> None:
        """Build (or rebuild) the block's buffer in a derived precision from its full-precision master."""
        bb = self.blocks[block]
        if not bb.has_master:
            raise RuntimeError(f"block {block}: no full-precision weights to build {precision} from")
        self._rows_in(precision)
        new = precision not in bb.buffers
        if new:
            self.allocate(block, precision)
        try:
            self._write_derived(block, precision)
        except BaseException:
            if new:  # a half-written buffer must not look built
                self._drop(block, precision)
            raise
        self.mark_built(block, precision)

    def master_weight(self, block: int, position: int) -> torch.Tensor:
        """One layer's master weight as the [out, in] matrix of its linear map."""
        bb = self.blocks[block]
        if bb.file_master is not None:
            return bb.layers[position].as_matrix(bb.file_master[position].detach())
        master = precisions.master()
        lay = bb.layouts[master.name][position]
        w = master.views(bb.full, lay)[0]
        return w.t() if lay.transposed else w

    def build_missing(self, precision_map: dict[int, str], progress) -> None:
        """Build every copy the map streams that the store lacks: one host allocation per precision. Built on the
        GPU, each block's master is page-locked while its block is built (unless it stays locked anyway)."""
        missing = [(b, p) for b, p in precision_map.items() if not self.has(b, p)]
        kinds = sorted({p for _, p in missing})
        for precision in kinds:
            self.reserve(precision, [b for b, p in missing if p == precision])
        for block, precision in progress(missing, f"offload: building {'/'.join(kinds)} copies"):
            locked = self.quant_device is not None and self._lock_for_copy(block, precisions.FULL)  # it goes up
            try:
                self.build(block, precision)
            finally:
                if locked and not self._stays_locked(block, precisions.FULL, precision_map.get(block)):
                    self._arena_of[(block, precisions.FULL)].unlock(self.blocks[block].full)  # drains first
            if self.after_file_read is not None and self.blocks[block].file_master is not None:
                self.after_file_read()  # the file pages just read leave our RSS (they stay in the page cache)
        host_copy.release()

    def _write_derived(self, block: int, precision: str) -> None:
        if not self.writes(block, precision):
            return  # the block's owner on this node builds it into the same pages
        bb, entry = self.blocks[block], precisions.get(precision)
        for position, (spec, lay) in enumerate(zip(bb.layers, bb.layouts[precision])):
            w = self.master_weight(block, position)
            if self.quant_device is not None:
                w = w.to(self.quant_device, non_blocking=True)
            try:
                entry.write(bb.buffers[precision], lay, w, self.quantizer)
            except ValueError as e:  # e.g. a NaN or Inf the quantizer refuses: say which layer holds it
                raise type(e)(f"stagehand: layer {spec.fqn} (block {block}), building its {precision} copy: {e}") from e

    def mark_built(self, block: int, precision: str) -> None:
        """Record the master version the precision's buffer now matches (None: there is no master)."""
        self.blocks[block].source_versions[precision] = self.master_version(block)

    def has(self, block: int, precision: str) -> bool:
        return precision in self.blocks[block].buffers or (block, precision) in self.on_disk

    def attach_disk_tier(self, tier, precision: str) -> None:
        """Every block's `precision` copy streams from the file through `tier` (never held in RAM)."""
        self.disk_tier = tier
        self.arenas.append(tier.arena)
        self.on_disk = {(b, precision) for b in range(len(self.blocks))}

    def copied(self, block: int, precision: str, stream) -> None:
        """The slot pool issued the H2D copy of the block's buffer on `stream` (None: a synchronous copy)."""
        if (block, precision) in self.on_disk:
            self.disk_tier.copied(block, stream)

    def can_stream(self, block: int, precision: str) -> bool:
        """Held already, or derived (every precision but the master's own flat buffer) from a master it has."""
        bb = self.blocks[block]
        derived = precisions.get(precision).derived_from_master or bb.file_master is not None
        return self.has(block, precision) or (derived and bb.has_master)

    def fetching(self) -> None:
        """A block's bytes are about to be read for a device copy: `before_fetch`, once, outside any backward."""
        if self.before_fetch is not None and torch._C._current_graph_task_id() == -1:
            hook, self.before_fetch = self.before_fetch, None
            hook()

    def ensure_fresh(self, block: int, precision: str) -> None:
        """A buffer built from weights that were written since gets rebuilt (never streamed stale)."""
        bb = self.blocks[block]
        built_from = bb.source_versions.get(precision)
        if bb.has_master and built_from is not None and built_from != self.master_version(block):
            log.info("stagehand: block %d full-precision weights changed; rebuilding its %s copy", block, precision)
            self.build(block, precision)
            self.requantized_blocks += 1

    def mark_written(self, block: int) -> None:
        """The block's master is (about to be) written without moving its version counter (torch's fused CPU
        optimizers): move it, so every copy of the block is refreshed before it is served again."""
        bb = self.blocks[block]
        for t in bb.file_master if bb.file_master is not None else [bb.full] if bb.full is not None else []:
            torch.autograd.graph.increment_version(t)

    def master_version(self, block: int) -> int | None:
        """The version counter of the block's master (None: no master): the weights are views of one buffer and
        share its counter, so every write to one moves it."""
        bb = self.blocks[block]
        if bb.file_master is not None:  # each weight is a tensor of its own on the mapping: their sum
            return sum(w._version for w in bb.file_master)
        return None if bb.full is None else bb.full._version

    def buffer(self, block: int, precision: str) -> torch.Tensor:
        self._rows_in(precision)
        buf = self.blocks[block].buffers.get(precision)
        if buf is None and (block, precision) in self.on_disk:
            return self.disk_tier.fetch(block)
        if buf is None:
            raise RuntimeError(f"block {block} has no {precision} weights in the host store")
        return buf

    def _rows_in(self, precision: str) -> None:
        """A slab's rows read behind offload are in before any INT8 buffer is read or written (else their error)."""
        if self.rows_behind is not None and precision == precisions.INT8:
            self.rows_behind.wait()

    def layout(self, block: int, precision: str) -> list[LayerLayout]:
        bb = self.blocks[block]
        if precision not in bb.layouts:
            bb.layouts[precision] = precisions.get(precision).layout(bb.layers)[0]
        return bb.layouts[precision]

    def nbytes(self, block: int, precision: str) -> int:
        buf = self.blocks[block].buffers.get(precision)
        return buf.numel() if buf is not None else precisions.get(precision).layout(self.blocks[block].layers)[1]

    def max_block_bytes(self) -> int:
        """The slot size: the largest block in any precision it can stream in."""
        return max(self.nbytes(b, name) for b in range(len(self.blocks)) for name in precisions.names()
                   if self.can_stream(b, name))

    def host_bytes(self) -> int:
        """Bytes of host memory the store's buffers hold (a file master is not in it)."""
        return sum(buf.numel() for bb in self.blocks for buf in bb.buffers.values())
