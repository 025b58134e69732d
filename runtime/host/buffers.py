"""One block's host copies (the host store's entry per block, host/store.py): a flat buffer per precision,
its layout, the master version each derived buffer was built from, and a mapped file's weights when the
file is the master."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.blocks import StreamedLayerSpec
from torch_stagehand.runtime.precision import LayerLayout


@dataclass
class BlockBuffers:
    layers: list[StreamedLayerSpec]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # precision name -> flat uint8 buffer
    layouts: dict[str, list[LayerLayout]] = field(default_factory=dict)
    # The master's version counter when a derived buffer was built from it: a later
    # in-place write (load_state_dict, optimizer on a view) makes that buffer stale.
    # None: not built from the master (read from a slab with no master to compare).
    source_versions: dict[str, int | None] = field(default_factory=dict)
    # keep_full="file": the layers' weights as views of the safetensors file (their stored
    # orientation); they are the master, and a flat full-precision buffer is derived from them.
    file_master: list[torch.Tensor] | None = None

    @property
    def full(self) -> torch.Tensor | None:
        """The flat full-precision buffer (the master, unless the master is in the file; None if absent)."""
        return self.buffers.get(precisions.FULL)

    @property
    def has_master(self) -> bool:
        return self.file_master is not None or self.full is not None

    def nbytes(self, precision: str) -> int:
        buf = self.buffers.get(precision)
        return 0 if buf is None else buf.numel()
