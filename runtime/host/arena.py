"""Host arenas: a few large host allocations, carved into per-block buffers, pinned at their real size.

PyTorch's pinned allocator rounds every request up to a power of two. Here a set of buffers is one pageable
allocation whose streamed ranges are page-locked in place (`cudaHostRegister`), each buffer on its own pages;
locking commits pages, so a range is locked after it is filled.
"""

from __future__ import annotations

import logging
import os
import weakref

import torch

log = logging.getLogger(__name__)

PAGE = 4096


def page_round(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def new_memfd(kind: str, nbytes: int) -> int:
    """A memfd of `nbytes` named in /proc after `kind`, on no file system: its pages go with its last fd and mapping."""
    fd = os.memfd_create(f"stagehand-{kind.replace(' ', '-')}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_memfd(fd: int, nbytes: int) -> torch.Tensor:
    """The pages of a memfd this process holds open as `fd`, mapped shared (page-aligned uint8 of `nbytes`)."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


class PinError(RuntimeError):
    """cudaHostRegister refused a range (the driver's error code and the size are in the message)."""


class NoPinner:
    """Pins nothing (CPU streams, `Config.pin_memory=False`)."""

    locks = False

    def register(self, ptr: int, nbytes: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def unregister(self, ptr: int) -> None:
        pass


class CudaPinner:
    """Page-locks host ranges in place through the CUDA runtime (as `torch.cuda._pin_memory_utils` does)."""

    locks = True
    PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as pin_memory=True is

    def register(self, ptr: int, nbytes: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, self.PORTABLE))
        if err != 0:
            raise PinError(f"cudaHostRegister of {nbytes / 2**20:.1f} MiB failed with cudaError {err}")

    def drain(self) -> None:
        """Every copy still reading a locked range finishes: once before a batch of `unregister`s."""
        try:
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - at interpreter exit CUDA may be gone
            log.debug("stagehand: synchronize before cudaHostUnregister skipped: %s", e)

    def unregister(self, ptr: int) -> None:
        """Unlock a range; the caller drained first (a copy still reading it must not lose its pages)."""
        try:
            err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        except Exception as e:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the pages go with the process
            log.debug("stagehand: cudaHostUnregister skipped: %s", e)
            return
        if err != 0:
            log.warning("stagehand: cudaHostUnregister failed with cudaError %d", err)


class HostArena:
    """One host allocation holding the buffers of one copy kind (e.g. "int8 pinned")."""

    def __init__(self, kind: str, sizes: list[int], pinner, shared=None, backing=None):
        """`shared`: the node's NodeStore (host/node_store.py), whose pages these are. `backing`: where this
        process's pages come from when not from torch (`backing(kind, nbytes)`, page-aligned: slab/read_process.py)."""
        self.kind = kind
        self.pinner = pinner
        self.capacity = sum(page_round(n) for n in sizes)
        self.shared = shared is not None
        if shared is not None or backing is not None:
            self.base = (shared or backing).backing(kind, self.capacity)  # a mapping: page-aligned
        else:  # one spare page so the start can be moved onto a page boundary
            raw = torch.empty(self.capacity + PAGE, dtype=torch.uint8)
            skip = (-raw.data_ptr()) % PAGE
            self.base = raw[skip : skip + self.capacity]
        self._next = 0
        self.requested = sum(sizes)
        self.pin_refusals = 0  # ranges left pageable because page-locking was refused (lock_or_fall_back)
        self.locked: dict[int, int] = {}  # start pointer -> locked bytes
        # Unlock before the memory can go back to the allocator, however the arena dies.
        self._finalizer = weakref.finalize(self, _unlock_all, pinner, self.locked)

    def carve(self, nbytes: int) -> torch.Tensor:
        if self._next + page_round(nbytes) > self.capacity:
            raise RuntimeError(f"host arena {self.kind}: {nbytes} bytes do not fit ({self.capacity - self._next} left)")
        # A tensor of its own (not a view): its own version counter, so a write to one block's weights does not
        # make the others stale. On a storage of its own that starts at its first byte (a slice of the base's,
        # which it keeps alive): `is_pinned()` asks about a storage's first byte, so it tells this buffer's lock.
        start = self.base.storage_offset() + self._next
        view = torch.empty(0, dtype=torch.uint8).set_(
            self.base.untyped_storage()[start : start + nbytes], 0, (nbytes,), (1,))
        self._next += page_round(nbytes)
        return view

    def lock(self, view: torch.Tensor) -> None:
        """Page-lock the range of one carved buffer (its pages, exactly)."""
        ptr = view.data_ptr()
        if ptr in self.locked or not self.pinner.locks or view.numel() == 0:
            return
        nbytes = page_round(view.numel())
        self.pinner.register(ptr, nbytes)
        self.locked[ptr] = nbytes

    def unlock(self, view: torch.Tensor, drained: bool = False) -> None:
        """Unlock one buffer's range; `drained`: the caller already drained the pinner for a batch."""
        ptr = view.data_ptr()
        if self.locked.pop(ptr, None) is not None:
            if not drained:
                self.pinner.drain()
            self.pinner.unregister(ptr)

    def is_locked(self, view: torch.Tensor) -> bool:
        return view.data_ptr() in self.locked

    def close(self) -> None:
        self._finalizer()

    @property
    def locked_bytes(self) -> int:
        return sum(self.locked.values())


def _unlock_all(pinner, locked: dict[int, int]) -> None:
    if locked:
        pinner.drain()
    for ptr in list(locked):
        locked.pop(ptr)
        pinner.unregister(ptr)


def locked_memory_limit() -> str:
    """The process's locked-memory limit (`ulimit -l`), as a person reads it."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"
    except (ImportError, OSError, ValueError):
        return "unknown"


PAGEABLE_COST = "copies from pageable memory are staged by the driver (~20 GB/s H2D on an H200 against ~55 pinned)"


def lock_or_fall_back(arena: HostArena, view: torch.Tensor, what: str, refuse: bool) -> bool:
    """Page-lock `view` (`what` names it); True if locked. A refusal (the locked-memory limit, the driver) is an
    OutOfMemoryError when `refuse` (during offload); else the buffer stays pageable, with a warning."""
    try:
        arena.lock(view)
        return True
    except PinError as e:
        why = (f"could not pin {what} ({view.numel() / 2**20:.1f} MiB): {e}; the locked-memory limit "
               f"(ulimit -l) is {locked_memory_limit()}")
        if refuse:
            raise torch.OutOfMemoryError(f"offload: {why}. Config(pin_memory=False) streams from pageable memory "
                                         f"instead: {PAGEABLE_COST}") from e
        log.warning("stagehand: %s. It stays pageable: %s", why, PAGEABLE_COST)
        arena.pin_refusals += 1
        return False


def pinner_for(device: torch.device, pin_memory: bool):
    """What locks the host ranges that stream to `device` (tests replace this with a recording fake)."""
    return CudaPinner() if pin_memory and torch.device(device).type == "cuda" else NoPinner()
