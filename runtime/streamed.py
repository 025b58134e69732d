"""Streamed Linear modules: the same module objects, with a class swapped in.

`offload` changes `module.__class__` from `nn.Linear` (or transformers'
`Conv1D`) to a subclass made here, so `isinstance(m, nn.Linear)` still holds
(peft, HF and diffusers code keeps working), the module tree and FQNs stay the
same, and `restore()` swaps the class back. The subclass:

* forwards through `stagehand::streamed_linear`, the op the backend rewrites;
* keeps its weight on the host when the model is moved (`_apply` touches only
  the bias and buffers), like SquareQ's dtype protection;
* refuses to run when a streamed weight requires grad while grad is enabled:
  streamed weights are frozen bases (LoRA adapters stay resident and train).
"""

from __future__ import annotations

import torch
import torch.nn as nn


class StreamedWeightTrainableError(RuntimeError):
    pass


class StreamedMixin:
    _sh_layer: int  # global layer id (registry)
    _sh_fqn: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad and torch.is_grad_enabled():
            raise StreamedWeightTrainableError(
                f"stagehand: {self._sh_fqn}.weight requires grad but streams from the host store; "
                "streamed weights are frozen (train LoRA adapters, or call "
                f"{self._sh_fqn}.weight.requires_grad_(False), or run under torch.no_grad())"
            )
        return torch.ops.stagehand.streamed_linear(x, self.bias, self._sh_layer)

    def _apply(self, fn, recurse=True):
        # Only the bias and buffers follow .to()/.cuda()/.half(): the weight is the
        # host store's view, and converting it would silently duplicate or corrupt it.
        weight = self._parameters.pop("weight")
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = weight

    def __deepcopy__(self, memo):
        # A copy would alias the original's host store and slots through the layer id.
        raise TypeError(
            f"stagehand: {self._sh_fqn} is streamed; deepcopy the model before offload() or after restore()"
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, streamed (layer {self._sh_layer})"


_SUBCLASSES: dict[type, type] = {}


def streamed_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Streamed{cls.__name__}", (StreamedMixin, cls), {"_sh_original_class": cls})
    return _SUBCLASSES[cls]


def make_streamed(module: nn.Module, layer_id: int, fqn: str) -> None:
    module.__class__ = streamed_class(type(module))
    module._sh_layer = layer_id
    module._sh_fqn = fqn


def make_plain(module: nn.Module) -> None:
    module.__class__ = module._sh_original_class
    del module._sh_layer
    del module._sh_fqn


def is_streamed(module: nn.Module) -> bool:
    return isinstance(module, StreamedMixin)
