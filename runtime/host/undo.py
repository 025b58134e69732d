"""Offload as a transaction: what `offload` changes in a model (layer classes, streamed weights, meta biases, devices)
is recorded first, so a failure part-way puts the model back. The record keeps each weight's Parameter object (an
optimizer or a tie made before names it again) but not its memory, emptied once the store holds it; undo and
`restore()` refill the same objects. An object used outside the streamed layers keeps its data.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn

from torch_stagehand.runtime.blocks import StreamedLayerSpec
from torch_stagehand.runtime.streamed import is_streamed, make_plain


def named_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


class OffloadUndo:
    def __init__(self, model: nn.Module, layers: list[StreamedLayerSpec]):
        self.model = model
        self.layers = layers
        self.devices = {name: t.device for name, t in named_tensors(model)}
        self.requires_grad = {s.fqn: s.weight.requires_grad for s in layers}
        self._originals = {s.fqn: s.weight for s in layers}  # the objects; their memory is released
        self._copies_left = Counter(id(w) for w in self._originals.values())  # layers still to copy each object
        streamed = {s.weight_name for s in layers}
        self._used_elsewhere = {id(p) for name, p in model.named_parameters(remove_duplicate=False)
                                if name not in streamed}
        self._emptied: dict[int, torch.device] = {}  # id -> the device it was on
        self._refilled: set[int] = set()
        self._biases = {s.fqn: s.module._parameters.get("bias") for s in layers}  # small; a slab may replace meta ones
        # A meta model loaded from its checkpoint by offload: its meta tensors go back in place of what was loaded.
        self._meta = [(module, kind, name, t) for module in model.modules() for kind in ("_parameters", "_buffers")
                      for name, t in getattr(module, kind).items() if t is not None and t.is_meta]
        # A rank of a node sharing its store keeps its weights until the store is sealed (other ranks' blocks).
        self._deferred: list[tuple[StreamedLayerSpec, torch.Tensor]] | None = None

    def defer_releases(self) -> None:
        self._deferred = []

    def release_deferred(self) -> None:
        """The store holds every weight now (the node's store is sealed): release what was kept."""
        deferred, self._deferred = self._deferred or [], None
        for spec, original in deferred:
            self.replaced(spec, original)

    def replaced(self, spec: StreamedLayerSpec, original: torch.Tensor) -> None:
        """The host store holds `spec`'s weight now and the module a view of it (HostStore.on_replaced): once
        every layer sharing `original` is copied, its memory goes; the object stays, empty, for undo."""
        if self._deferred is not None:
            self._deferred.append((spec, original))
            return
        key = id(original)
        self._copies_left[key] -= 1
        if self._copies_left[key] or key in self._used_elsewhere or original.is_meta or key in self._emptied:
            return
        self._emptied[key] = original.device
        with torch.no_grad():
            original.data = torch.empty(0, dtype=original.dtype, device=original.device)

    def _refill(self, spec: StreamedLayerSpec, device: torch.device | None = None) -> nn.Parameter:
        """The layer's original Parameter object, its values again (from the store's copy) if they were released."""
        original = self._originals[spec.fqn]
        was_on = self._emptied.pop(id(original), None)
        if was_on is not None:
            with torch.no_grad():
                original.data = spec.weight.detach().to(device or was_on, copy=True)
            self._refilled.add(id(original))
        return original

    def undo(self) -> None:
        """Put every layer back as it was recorded (whatever part of offload ran): the same Parameter objects."""
        with torch.no_grad():
            for spec in self.layers:
                module = spec.module
                if is_streamed(module):
                    make_plain(module)
                module._parameters[spec.param] = self._refill(spec)
                if "bias" in module._parameters and module._parameters["bias"] is not self._biases[spec.fqn]:
                    module._parameters["bias"] = self._biases[spec.fqn]
            for module, kind, name, t in self._meta:
                getattr(module, kind)[name] = t
            self.move_back()

    def plain_weight(self, spec: StreamedLayerSpec, restoring: bool = False) -> None:
        """The layer's weight back on its original device with the host store's values (restore()): the original
        Parameter object where offload released it, else a Parameter of its own. `restoring`: a weight that was on
        the meta device comes back on the CPU."""
        device = self.devices[spec.weight_name]
        if restoring and device.type == "meta":
            device = torch.device("cpu")
        key = id(self._originals[spec.fqn])
        if key in self._emptied or key in self._refilled:  # released by offload (a tie: refilled by its first layer)
            weight = self._refill(spec, device)
            weight.requires_grad_(self.requires_grad[spec.fqn])
        else:  # kept its memory: meta, or used by a module outside the streamed layers
            weight = nn.Parameter(spec.weight.detach().to(device, copy=True),
                                  requires_grad=self.requires_grad[spec.fqn])
        spec.module._parameters[spec.param] = weight

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
