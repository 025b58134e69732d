"""LoRA on streamed expert stacks: peft's `target_parameters` wrappers, made to read the stream.

peft parametrizes the experts module per forward, which a streamed stack (no `original` on the device) cannot
take; so offload swaps each `ParamWrapper`'s class: its forward calls the wrapped module, and the stack property
hands the stream to `adapted(w)`, which adds each active adapter as `baddbmm(w, lhs, rhs, alpha=scaling)`. Merging
into a streamed stack is refused: the stream would not see it."""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from torch_stagehand.runtime.streamed import StreamedExpertsMixin


class StreamedLoraMergeError(RuntimeError):
    """An adapter merge into a streamed expert stack: the host master is what streams."""


_SUBCLASSES: dict[type, type] = {}


def adopt_expert_adapters(model: nn.Module) -> int:
    """Swap the class of every peft ParamWrapper around a streamed expert stack; returns how many."""
    # Only where peft was imported can a model hold its wrapper: never import it here (it pulls in transformers).
    # None: peft not in use, or a version without target_parameters.
    wrapper_cls = getattr(sys.modules.get("peft.tuners.lora.layer"), "ParamWrapper", None)
    if wrapper_cls is None:
        return 0
    adopted = 0
    for module in model.modules():
        if not isinstance(module, wrapper_cls) or isinstance(module, StreamedParamWrapperMixin):
            continue
        base = module.get_base_layer()
        if not isinstance(base, StreamedExpertsMixin) or module.parameter_name not in base._sh_params:
            continue
        cls = type(module)
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(f"Streamed{cls.__name__}", (StreamedParamWrapperMixin, cls),
                                    {"_sh_original_class": cls})
        module.__class__ = _SUBCLASSES[cls]
        base.__dict__.setdefault("_sh_lora", {}).setdefault(module.parameter_name, []).append(module)
        adopted += 1
    return adopted


def release_expert_adapters(model: nn.Module) -> None:
    """The wrappers' own classes again (restore)."""
    for module in model.modules():
        if isinstance(module, StreamedParamWrapperMixin):
            module.__class__ = module._sh_original_class
        module.__dict__.pop("_sh_lora", None)


class StreamedParamWrapperMixin:
    """A peft ParamWrapper whose stack streams (see the module's docstring)."""

    def forward(self, x, *args, **kwargs):
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.get("adapter_names") is not None:
            raise ValueError(f"lora.{type(self).__name__} does not support mixed batch inference")
        kwargs.pop("adapter_names", None)
        return self.base_layer(x, *args, **kwargs)

    def get_param(self):
        # What peft's delta code reads of the parameter: its dtype and device (the parameter is the host master).
        base = self.get_base_layer()
        return torch.empty(0, dtype=base._sh_stacks[self.parameter_name][2], device=base._sh_device)

    def adapted(self, w: torch.Tensor) -> torch.Tensor:
        """The streamed stack `w` with this wrapper's active adapters added, as peft's proxies add them."""
        if self.disable_adapters or self.merged:
            return w
        adapters = [a for a in self.active_adapters if a in self.lora_A]
        # One baddbmm per adapter (peft sums several as deltas: the same update, rounded in another order).
        with torch.autocast(device_type=w.device.type, enabled=False):
            for adapter in adapters:
                lhs, rhs, scaling = self.get_delta_factors(adapter)
                w = torch.baddbmm(w, lhs, rhs, alpha=scaling)
        return w

    def merge(self, *args, **kwargs):
        raise StreamedLoraMergeError(
            f"stagehand: the adapter on {self.parameter_name} of a streamed expert stack can not be merged into "
            "it (the host master streams); restore() the Runtime first, then merge")

    def unmerge(self, *args, **kwargs):
        if self.merged:
            raise StreamedLoraMergeError("stagehand: a streamed expert stack holds no merged adapter")
