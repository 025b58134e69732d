"""The host store: the master copy of every streamed weight, one flat buffer per
block per precision.

A block's full-precision buffer holds its Linear weights exactly as the model
had them (dtype and layout); the modules' `weight` parameters become views into
it, so `state_dict()` and `load_state_dict()` see and update the real weights.
Every other precision's buffer is derived from it (or read from a slab file) by
that precision's registry entry, which also says how the buffer is laid out.
All are pinned when the stream goes to a CUDA device. Streaming only ever reads
these buffers: the host copy is the master and is never modified by it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from . import precision as precisions
from .blocks import StreamedLayerSpec
from .precision import LayerLayout
from .streamed import StreamedDtypeError

log = logging.getLogger(__name__)


@dataclass
class BlockBuffers:
    layers: list[StreamedLayerSpec]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # precision name -> flat uint8 buffer
    layouts: dict[str, list[LayerLayout]] = field(default_factory=dict)
    # The master's version counter when a derived buffer was built from it: a later
    # in-place write (load_state_dict, optimizer on a view) makes that buffer stale.
    # None: not built from the master (read from a slab with no master to compare).
    source_versions: dict[str, int | None] = field(default_factory=dict)

    @property
    def full(self) -> torch.Tensor | None:
        """The master: the model's own weights (None for a block read from a slab only)."""
        return self.buffers.get(precisions.FULL)

    def nbytes(self, precision: str) -> int:
        buf = self.buffers.get(precision)
        return 0 if buf is None else buf.numel()


class HostStore:
    def __init__(self, layers: list[StreamedLayerSpec], n_blocks: int, pin: bool, quantizer: str, quant_device=None):
        self.pin = pin
        self.quantizer = quantizer
        # Quantizing 10 GB of weights on two CPU cores takes minutes; on the GPU, seconds.
        self.quant_device = quant_device
        self.blocks = [BlockBuffers(layers=[s for s in layers if s.block == b]) for b in range(n_blocks)]
        # Derived copies rebuilt because their master was written after they were built.
        self.requantized_blocks = 0

    # ---- building -----------------------------------------------------------

    def _empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def adopt_full(self, block: int) -> bool:
        """Move the block's weights into one flat buffer; the modules keep views of it.

        Returns False (and keeps nothing) when the weights are on the meta
        device: such a block can only stream what a slab provides.
        """
        bb = self.blocks[block]
        if any(spec.module.weight.is_meta for spec in bb.layers):
            return False
        entry = precisions.master()
        buf = self.allocate(block, entry.name)
        for spec, lay in zip(bb.layers, bb.layouts[entry.name]):
            requires_grad = spec.module.weight.requires_grad
            with torch.no_grad():
                entry.write(buf, lay, _linear_weight(spec), self.quantizer)
            # Replace the parameter object: the old storage (possibly on the GPU) is freed.
            view = entry.views(buf, lay)[0]
            spec.module._parameters["weight"] = torch.nn.Parameter(view, requires_grad=requires_grad)
        return True

    def allocate(self, block: int, precision: str) -> torch.Tensor:
        """An empty buffer in the precision's layout (filled by `build` or a slab reader)."""
        bb = self.blocks[block]
        layout, nbytes = precisions.get(precision).layout(bb.layers)
        try:
            buf = self._empty(nbytes)
        except torch.OutOfMemoryError as e:  # say what did not fit: offload then puts the model back
            where = "pinned host" if self.pin else "host"
            raise torch.OutOfMemoryError(
                f"offload: no {where} memory for block {block}'s {precision} copy ({nbytes / 2**20:.1f} MiB, first "
                f"layer {bb.layers[0].fqn}): {e}"
            ) from e
        bb.buffers[precision], bb.layouts[precision] = buf, layout
        return bb.buffers[precision]

    def build(self, block: int, precision: str) -> None:
        """Build (or rebuild) the block's buffer in a derived precision from its full-precision master."""
        bb = self.blocks[block]
        if bb.full is None:
            raise RuntimeError(f"block {block}: no full-precision weights to build {precision} from")
        new = precision not in bb.buffers
        if new:
            self.allocate(block, precision)
        try:
            self._write_derived(block, precision)
        except BaseException:
            if new:  # a half-written buffer must not look built
                del bb.buffers[precision], bb.layouts[precision]
            raise
        self.mark_built(block, precision)

    def _write_derived(self, block: int, precision: str) -> None:
        bb, entry = self.blocks[block], precisions.get(precision)
        master = precisions.master()
        for spec, master_lay, lay in zip(bb.layers, bb.layouts[master.name], bb.layouts[precision]):
            w = master.views(bb.full, master_lay)[0]
            w = w.t() if master_lay.transposed else w
            if self.quant_device is not None:
                w = w.to(self.quant_device, non_blocking=True)
            try:
                entry.write(bb.buffers[precision], lay, w, self.quantizer)
            except ValueError as e:  # e.g. a NaN or Inf the quantizer refuses: say which layer holds it
                raise type(e)(f"stagehand: layer {spec.fqn} (block {block}), building its {precision} copy: {e}") from e

    def mark_built(self, block: int, precision: str) -> None:
        """Record the master version the precision's buffer now matches (None: there is no master)."""
        bb = self.blocks[block]
        bb.source_versions[precision] = None if bb.full is None else bb.full._version

    # ---- reading ------------------------------------------------------------

    def has(self, block: int, precision: str) -> bool:
        return precision in self.blocks[block].buffers

    def can_stream(self, block: int, precision: str) -> bool:
        """Held already, or derived and buildable from a master the block has."""
        bb = self.blocks[block]
        return self.has(block, precision) or (precisions.get(precision).derived_from_master and bb.full is not None)

    def ensure_fresh(self, block: int, precision: str) -> None:
        """A buffer built from weights that were written since gets rebuilt (never streamed stale)."""
        bb = self.blocks[block]
        built_from = bb.source_versions.get(precision)
        if bb.full is not None and built_from is not None and built_from != bb.full._version:
            log.info("stagehand: block %d full-precision weights changed; rebuilding its %s copy", block, precision)
            self.build(block, precision)
            self.requantized_blocks += 1

    def master_version(self, block: int) -> int | None:
        """The version counter of the block's master buffer (None: no master). Every write to a
        streamed weight moves it: the weights are views of this buffer and share its counter."""
        full = self.blocks[block].full
        return None if full is None else full._version

    def buffer(self, block: int, precision: str) -> torch.Tensor:
        buf = self.blocks[block].buffers.get(precision)
        if buf is None:
            raise RuntimeError(f"block {block} has no {precision} weights in the host store")
        return buf

    def layout(self, block: int, precision: str) -> list[LayerLayout]:
        bb = self.blocks[block]
        if precision not in bb.layouts:
            bb.layouts[precision] = precisions.get(precision).layout(bb.layers)[0]
        return bb.layouts[precision]

    def nbytes(self, block: int, precision: str) -> int:
        if self.has(block, precision):
            return self.blocks[block].nbytes(precision)
        return precisions.get(precision).layout(self.blocks[block].layers)[1]

    def max_block_bytes(self) -> int:
        """The slot size: the largest block in any precision it can stream in."""
        return max(
            self.nbytes(b, name) for b in range(len(self.blocks)) for name in precisions.names() if self.can_stream(b, name)
        )

    def host_bytes(self) -> int:
        return sum(buf.numel() for bb in self.blocks for buf in bb.buffers.values())


def check_master_dtypes(layers: list[StreamedLayerSpec]) -> None:
    """Refuse, before anything moves, a streamed weight the master can not hold (float64, integer types)."""
    supported = precisions.master().dtypes
    for spec in layers:
        dtype = spec.module.weight.dtype
        if dtype not in supported:
            names = ", ".join(str(d).removeprefix("torch.") for d in supported)
            raise StreamedDtypeError(
                f"offload: {spec.fqn}.weight is {dtype}; streamed weights must be one of {names} "
                f"(convert the model first, e.g. model.to(torch.bfloat16))"
            )


def _linear_weight(spec: StreamedLayerSpec) -> torch.Tensor:
    """The module's weight as the [out, in] matrix of its linear map."""
    w = spec.module.weight.detach()
    return w.t() if spec.transposed else w
