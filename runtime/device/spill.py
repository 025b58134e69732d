"""Activation spill: saved activations go to pinned host memory on a D2H stream in the forward (PCIe is full
duplex) and come back for the backward, through the `saved_tensors_hooks` of `hooks(block)`; host buffers are
pooled by size across steps. The way back is prefetched: when the backward's schedule names the block it runs next
(the plan driver's prefetch), `restore(block)` copies that block's activations up on the weights' H2D stream,
ahead of the weight copies that call issues after it, so they arrive while the block after it computes; a tensor
not restored ahead (the first block of the backward, a block the schedule did not name) comes back when the
backward reads it, on the compute stream. On the CPU: plain copies."""

from __future__ import annotations

from collections import defaultdict

import torch

MIN_SPILL_BYTES = 64 * 1024  # smaller saved tensors stay where they are: not worth a copy each way


class _Spilled:
    """One saved tensor on the host: its buffer, the D2H copy's event, its block, and its copy back once issued."""

    __slots__ = ("host", "event", "block", "restored", "ready")

    def __init__(self, host: torch.Tensor, event, block: int):
        self.host, self.event, self.block = host, event, block
        self.restored: torch.Tensor | None = None  # on the device, written by `restore` (ready when `ready` is)
        self.ready = None


class ActivationSpill:
    def __init__(self, device: torch.device, pin: bool):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            # "cuda" never equals a tensor's "cuda:0": with no index, the device that is current now.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin = pin and self.cuda
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._saved: dict[int, list[_Spilled]] = {}  # block -> its tensors on the host, not yet read back
        self.d2h_bytes = self.h2d_bytes = self.spilled_tensors = 0
        self.restored_ahead_bytes = 0  # of h2d_bytes: copied up by `restore`, before the backward read them
        self.host_bytes = 0  # the host buffers' bytes, pooled across steps (counted in the plan's spill room)

    def hooks(self, block: int):
        """The saved-tensor hooks of one run of `block`'s forward (what an earlier run left unread is let go)."""
        self._saved[block] = []
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, block), self._unpack)

    def restore(self, block: int, stream) -> None:
        """Copy the block's spilled activations back to the device now, on `stream` (the H2D copies' stream; None
        on the CPU), so that its backward finds them there."""
        for packed in self._saved.get(block, ()):
            if packed.restored is not None:
                continue
            if self.cuda:
                stream.wait_event(packed.event)  # its way out is done
                with torch.cuda.stream(stream):
                    packed.restored = torch.empty(packed.host.shape, dtype=packed.host.dtype, device=self.device)
                    packed.restored.copy_(packed.host, non_blocking=True)
                    packed.ready = stream.record_event()
                # Allocated on the copy stream, read on the compute stream: not reused before that read is done.
                packed.restored.record_stream(torch.cuda.current_stream(self.device))
            else:
                packed.restored = packed.host.clone()

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        free = self._free[(tuple(t.shape), t.dtype)]
        if free:
            return free.pop()
        self.host_bytes += t.numel() * t.element_size()
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)

    def _pack(self, t: torch.Tensor, block: int):
        if not (t.device == self.device and t.is_contiguous() and not isinstance(t, torch.nn.Parameter)
                and not (t.is_leaf and t.requires_grad) and t.numel() * t.element_size() >= MIN_SPILL_BYTES
                and type(t) is torch.Tensor):
            return t
        host = self._buffer(t)
        event = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                event = self.stream.record_event()
            t.record_stream(self.stream)  # its memory is reused only after the copy
        else:
            host.copy_(t)
        self.d2h_bytes += t.numel() * t.element_size()
        self.spilled_tensors += 1
        packed = _Spilled(host, event, block)
        self._saved.setdefault(block, []).append(packed)
        return packed

    def _unpack(self, packed):
        if not isinstance(packed, _Spilled):
            return packed
        saved = self._saved.get(packed.block, [])
        saved[:] = [p for p in saved if p is not packed]
        host, out = packed.host, packed.restored
        nbytes = host.numel() * host.element_size()
        if out is not None:  # restored ahead: the compute stream waits for that copy alone
            packed.restored = None
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(packed.ready)
            self.restored_ahead_bytes += nbytes
        elif self.cuda:
            torch.cuda.current_stream(self.device).wait_event(packed.event)
            out = host.to(self.device, non_blocking=True)
        else:
            out = host.clone()
        self.h2d_bytes += nbytes
        # The next D2H copy into this buffer is ordered after the copy back (the compute stream waited for it).
        self._free[(tuple(host.shape), host.dtype)].append(host)
        return out
