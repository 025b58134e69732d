"""Activation spill: saved activations go to pinned host memory on a D2H stream in the forward (PCIe is full
duplex) and come back for the backward, through the `saved_tensors_hooks` of `hooks()`; host buffers are pooled
by size across steps. On the CPU: plain copies."""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch

MIN_SPILL_BYTES = 64 * 1024  # smaller saved tensors stay where they are: not worth a copy each way


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
        self.d2h_bytes = self.h2d_bytes = self.spilled_tensors = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        free = self._free[(tuple(t.shape), t.dtype)]
        return free.pop() if free else torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)

    def _pack(self, t: torch.Tensor):
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
        return _Spilled(host, event)

    def _unpack(self, packed):
        if not isinstance(packed, _Spilled):
            return packed
        host = packed.host
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(packed.event)
            out = host.to(self.device, non_blocking=True)
        else:
            out = host.clone()
        self.h2d_bytes += out.numel() * out.element_size()
        self._free[(tuple(host.shape), host.dtype)].append(host)  # the next D2H copy is ordered after this one
        return out


class _Spilled(NamedTuple):
    host: torch.Tensor
    event: object
