"""Offload as a transaction: what `offload` changes in a model, recorded before it
changes it, so that a failure part-way (a NaN found while quantizing, a slab
that does not match, out of memory for the pinned store or the slots) puts the
model back as it was instead of leaving it half-offloaded.

Offload changes the model in three ways: it swaps each streamed layer's class
(`make_streamed`), replaces each streamed weight parameter by a view of the
host store (and a slab may fill meta biases), and moves everything else to the
device. The record holds no strong reference to a streamed weight: that would
keep every original weight alive until offload ends (twice the memory of a
model offloaded from the GPU). A weight someone else still holds goes back as
the same object (offload never writes into it); one that was freed is rebuilt
from the host store's copy of it on its original device: the same values,
dtype, device and requires_grad, a new Parameter object (as `restore()` does).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from .blocks import StreamedLayerSpec
from .streamed import is_streamed, make_plain


def named_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


class OffloadUndo:
    def __init__(self, model: nn.Module, layers: list[StreamedLayerSpec]):
        self.model = model
        self.layers = layers
        self.devices = {name: t.device for name, t in named_tensors(model)}
        self.requires_grad = {s.fqn: s.module.weight.requires_grad for s in layers}
        self._weights = {s.fqn: weakref.ref(s.module.weight) for s in layers}
        self._biases = {s.fqn: s.module._parameters.get("bias") for s in layers}  # small; a slab may replace meta ones
        # A model built on the meta device and loaded from its checkpoint by offload: its meta tensors
        # (they hold no memory) go back in place of what was loaded.
        self._meta = [(module, kind, name, t) for module in model.modules() for kind in ("_parameters", "_buffers")
                      for name, t in getattr(module, kind).items() if t is not None and t.is_meta]

    def undo(self) -> None:
        """Put every layer back as it was recorded (whatever part of offload ran)."""
        with torch.no_grad():
            for spec in self.layers:
                module = spec.module
                if is_streamed(module):
                    make_plain(module)
                original = self._weights[spec.fqn]()
                if original is not None:
                    # Still alive (the user or an optimizer holds it): offload never wrote into it, so it
                    # goes back as it was, the same object.
                    module._parameters["weight"] = original
                else:
                    self.plain_weight(spec)
                if "bias" in module._parameters and module._parameters["bias"] is not self._biases[spec.fqn]:
                    module._parameters["bias"] = self._biases[spec.fqn]
            for module, kind, name, t in self._meta:
                getattr(module, kind)[name] = t
            self.move_back()

    def plain_weight(self, spec: StreamedLayerSpec, restoring: bool = False) -> None:
        """The layer's weight as its own Parameter on its original device (a copy of the host store's view).

        `restoring`: a weight that was on the meta device (a model loaded from its checkpoint by
        offload) comes back on the CPU, with its values."""
        host = spec.module.weight.detach()
        device = self.devices[spec.fqn + ".weight"]
        if restoring and device.type == "meta":
            device = torch.device("cpu")
        spec.module._parameters["weight"] = nn.Parameter(
            host.to(device, copy=True), requires_grad=self.requires_grad[spec.fqn]
        )

    def move_back(self, restoring: bool = False) -> None:
        """Every other parameter and buffer back on the device it was on (offload moved them to the device);
        `restoring`: what was on the meta device (loaded from the checkpoint by offload) comes back on the CPU."""
        for name, tensor in named_tensors(self.model):
            original = self.devices.get(name)
            if original is not None and original.type == "meta":
                if not restoring:
                    continue  # put back as it was above
                original = torch.device("cpu")
            if original is not None and tensor.device != original:
                tensor.data = tensor.data.to(original)
