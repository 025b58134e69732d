"""The host store: the master copy of every streamed weight, one flat buffer per
block per precision.

A block's "full" buffer holds its Linear weights exactly as the model had them
(dtype and layout), packed at 256-byte aligned offsets; the modules' `weight`
parameters become views into it, so `state_dict()` and `load_state_dict()` see
and update the real weights. The "int8" buffer holds per-row symmetric INT8
rows plus fp32 scales, built from the full buffer or read from a slab file.
Both are pinned when the stream goes to a CUDA device. Streaming only ever
reads these buffers: the host copy is the master and is never modified by it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from torch_stagehand.kernels import quantize_per_row

from .blocks import StreamedLayerSpec

log = logging.getLogger(__name__)

ALIGN = 256
FULL, INT8 = "bf16", "int8"
PRECISIONS = (FULL, INT8)
# Small integer codes so layouts travel through custom-op schemas as int lists.
KIND_CODES = {FULL: 0, INT8: 1}
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.int8: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class LayerLayout:
    """Where one layer's weight lives inside its block's flat buffer (bytes)."""

    kind: int
    offset: int
    out_features: int
    in_features: int
    scale_offset: int  # INT8 only; -1 for full precision
    transposed: bool  # full precision Conv1D: stored [in, out]
    dtype_code: int

    def as_ints(self) -> list[int]:
        return [
            self.kind,
            self.offset,
            self.out_features,
            self.in_features,
            self.scale_offset,
            int(self.transposed),
            self.dtype_code,
        ]

    @staticmethod
    def from_ints(v: list[int]) -> "LayerLayout":
        return LayerLayout(v[0], v[1], v[2], v[3], v[4], bool(v[5]), v[6])


@dataclass
class BlockBuffers:
    layers: list[StreamedLayerSpec]
    full: torch.Tensor | None = None
    full_layout: list[LayerLayout] | None = None
    int8: torch.Tensor | None = None
    int8_layout: list[LayerLayout] | None = None
    # The full buffer's version counter when int8 was built from it: a later
    # in-place write (load_state_dict, optimizer on a view) makes int8 stale.
    int8_source_version: int | None = None

    def nbytes(self, precision: str) -> int:
        buf = self.full if precision == FULL else self.int8
        return 0 if buf is None else buf.numel()


def full_layout(layers: list[StreamedLayerSpec]) -> tuple[list[LayerLayout], int]:
    layout, offset = [], 0
    for spec in layers:
        w = spec.module.weight
        layout.append(
            LayerLayout(
                KIND_CODES[FULL], offset, spec.out_features, spec.in_features, -1, spec.transposed, DTYPE_CODES[w.dtype]
            )
        )
        offset = _align(offset + w.numel() * w.element_size())
    return layout, offset


def int8_layout(layers: list[StreamedLayerSpec]) -> tuple[list[LayerLayout], int]:
    layout, offset = [], 0
    for spec in layers:
        q_off = offset
        s_off = _align(q_off + spec.out_features * spec.in_features)
        offset = _align(s_off + 4 * spec.out_features)
        layout.append(
            LayerLayout(KIND_CODES[INT8], q_off, spec.out_features, spec.in_features, s_off, False, DTYPE_CODES[torch.int8])
        )
    return layout, offset


def layer_views(buf: torch.Tensor, lay: LayerLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, None) for full precision, (qweight, scale) for INT8, as views of `buf`."""
    n, k = lay.out_features, lay.in_features
    if lay.kind == KIND_CODES[FULL]:
        dtype = CODE_DTYPES[lay.dtype_code]
        size = n * k * torch.empty((), dtype=dtype).element_size()
        shape = (k, n) if lay.transposed else (n, k)
        return buf[lay.offset : lay.offset + size].view(dtype).view(shape), None
    q = buf[lay.offset : lay.offset + n * k].view(torch.int8).view(n, k)
    s = buf[lay.scale_offset : lay.scale_offset + 4 * n].view(torch.float32)
    return q, s


class HostStore:
    def __init__(self, layers: list[StreamedLayerSpec], n_blocks: int, pin: bool, quantizer: str, quant_device=None):
        self.pin = pin
        self.quantizer = quantizer
        # Quantizing 10 GB of weights on two CPU cores takes minutes; on the GPU, seconds.
        self.quant_device = quant_device
        self.blocks = [BlockBuffers(layers=[s for s in layers if s.block == b]) for b in range(n_blocks)]

    # ---- building -----------------------------------------------------------

    def _empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def adopt_full(self, block: int) -> bool:
        """Move the block's weights into one flat buffer; the modules keep views of it.

        Returns False (and keeps nothing) when the weights are on the meta
        device: such a block can only stream INT8 read from a slab.
        """
        bb = self.blocks[block]
        if any(spec.module.weight.is_meta for spec in bb.layers):
            return False
        layout, nbytes = full_layout(bb.layers)
        buf = self._empty(nbytes)
        for spec, lay in zip(bb.layers, layout):
            view, _ = layer_views(buf, lay)
            with torch.no_grad():
                view.copy_(spec.module.weight.detach())
            requires_grad = spec.module.weight.requires_grad
            # Replace the parameter object: the old storage (possibly on the GPU) is freed.
            spec.module._parameters["weight"] = torch.nn.Parameter(view, requires_grad=requires_grad)
        bb.full, bb.full_layout = buf, layout
        return True

    def allocate_int8(self, block: int) -> None:
        bb = self.blocks[block]
        layout, nbytes = int8_layout(bb.layers)
        bb.int8, bb.int8_layout = self._empty(nbytes), layout

    def quantize_block(self, block: int) -> None:
        """Build (or rebuild) the block's INT8 buffer from its full-precision master."""
        bb = self.blocks[block]
        if bb.full is None:
            raise RuntimeError(f"block {block}: no full-precision weights to quantize from")
        if bb.int8 is None:
            self.allocate_int8(block)
        for spec, full_lay, q_lay in zip(bb.layers, bb.full_layout, bb.int8_layout):
            w, _ = layer_views(bb.full, full_lay)
            w = w.t() if full_lay.transposed else w
            if self.quant_device is not None:
                w = w.to(self.quant_device, non_blocking=True)
            q, s = quantize_per_row(w, method=self.quantizer)
            q_view, s_view = layer_views(bb.int8, q_lay)
            q_view.copy_(q)
            s_view.copy_(s)
        bb.int8_source_version = bb.full._version

    # ---- reading ------------------------------------------------------------

    def has(self, block: int, precision: str) -> bool:
        bb = self.blocks[block]
        return (bb.full if precision == FULL else bb.int8) is not None

    def ensure_fresh(self, block: int, precision: str) -> None:
        """INT8 built from weights that were written since gets rebuilt (never streamed stale)."""
        bb = self.blocks[block]
        if precision == INT8 and bb.full is not None and bb.int8_source_version not in (None, bb.full._version):
            log.info("stagehand: block %d full-precision weights changed; re-quantizing its INT8 copy", block)
            self.quantize_block(block)

    def buffer(self, block: int, precision: str) -> torch.Tensor:
        bb = self.blocks[block]
        buf = bb.full if precision == FULL else bb.int8
        if buf is None:
            raise RuntimeError(f"block {block} has no {precision} weights in the host store")
        return buf

    def layout(self, block: int, precision: str) -> list[LayerLayout]:
        bb = self.blocks[block]
        if precision == FULL:
            if bb.full_layout is None:
                bb.full_layout = full_layout(bb.layers)[0]
            return bb.full_layout
        if bb.int8_layout is None:
            bb.int8_layout = int8_layout(bb.layers)[0]
        return bb.int8_layout

    def nbytes(self, block: int, precision: str) -> int:
        if self.has(block, precision):
            return self.blocks[block].nbytes(precision)
        return (full_layout if precision == FULL else int8_layout)(self.blocks[block].layers)[1]

    def max_block_bytes(self) -> int:
        """The slot size: the largest block in any precision it can stream in."""
        sizes = []
        for b, bb in enumerate(self.blocks):
            sizes.append(self.nbytes(b, INT8))
            if bb.full is not None:
                sizes.append(self.nbytes(b, FULL))
        return max(sizes)

    def host_bytes(self) -> int:
        return sum(bb.nbytes(FULL) + bb.nbytes(INT8) for bb in self.blocks)
