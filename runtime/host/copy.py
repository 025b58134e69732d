"""Device-to-host copies into the store's pageable buffers, through one pinned bounce buffer.

A GPU's copy into pageable memory goes through the driver's small staging buffers, slowly; through one pinned
buffer, at the link's speed. It grows to the largest tensor copied and `release()` frees it after a build.
"""

from __future__ import annotations

import torch

_bounce: list[torch.Tensor] = []  # [] or [one pinned uint8 buffer]


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, staged through pinned memory when `src` is on a GPU and `dst` is pageable host memory."""
    if not (src.is_cuda and dst.device.type == "cpu" and not dst.is_pinned()):
        dst.copy_(src)
        return
    if not dst.is_contiguous() and dst.dim() == 2 and dst.t().is_contiguous():
        dst, src = dst.t(), src.t()  # a transposed view of a flat buffer: copy in its storage order
    src = src.to(dst.dtype).contiguous()
    nbytes = src.numel() * src.element_size()
    if not _bounce or _bounce[0].numel() < nbytes:
        _bounce[:] = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)]
    staged = _bounce[0][:nbytes]
    staged.copy_(src.view(-1).view(torch.uint8))  # device -> pinned: synchronous, at the link's speed
    if dst.is_contiguous():
        dst.view(-1).view(torch.uint8).copy_(staged)
    else:  # e.g. rows padded to a slab's width: the host scatters them (the driver's pageable path is far slower)
        dst.copy_(staged.view(src.dtype).view(src.shape))


def release() -> None:
    """Free the bounce buffer (after a build: no pinned memory is held between builds)."""
    if _bounce:  # filled on CUDA builds only, whose caching host allocator keeps the freed block
        _bounce.clear()
        torch._C._host_emptyCache()
