"""Where a layer's weight sits in its block's flat uint8 buffer, as ints that travel through op schemas
(`as_ints()`); the first int is the precision code, which an op looks up (`registry.by_code`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Every layer starts on a 256-byte boundary: aligned loads for the kernels.
ALIGN = 256
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.int8: 3, torch.float8_e4m3fn: 4}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class LayerLayout:
    """Where one layer's weight lives inside its block's flat buffer (bytes)."""

    code: int  # the precision's code (registry.by_code)
    offset: int
    out_features: int
    in_features: int
    scale_offset: int  # precisions with a per-row scale; -1 otherwise
    transposed: bool  # stored [in, out] (GPT-2 Conv1D kept in the module's own layout)
    dtype_code: int  # DTYPE_CODES of the stored weight

    @property
    def dtype(self) -> torch.dtype:
        return CODE_DTYPES[self.dtype_code]

    def as_ints(self) -> list[int]:
        return [self.code, self.offset, self.out_features, self.in_features, self.scale_offset, int(self.transposed),
                self.dtype_code]

    @staticmethod
    def from_ints(v: list[int]) -> "LayerLayout":
        return LayerLayout(v[0], v[1], v[2], v[3], v[4], bool(v[5]), v[6])


def dense_view(buf: torch.Tensor, lay: LayerLayout) -> torch.Tensor:
    """A dense weight of `lay.dtype` inside `buf`, in its stored orientation ([in, out] if transposed)."""
    n, k, dtype = lay.out_features, lay.in_features, lay.dtype
    shape = (k, n) if lay.transposed else (n, k)
    return buf[lay.offset : lay.offset + n * k * dtype.itemsize].view(dtype).view(shape)


def logical(weight: torch.Tensor, lay: LayerLayout) -> torch.Tensor:
    """A stored weight as the [out, in] matrix that F.linear takes."""
    return weight.t() if lay.transposed else weight
