"""What counts as a Linear-like layer: `nn.Linear` and transformers' `Conv1D`.

One rule, in one place, because two parts of the package must agree on it:
the streaming engine (`blocks.py`) streams exactly the layers it calls Linear,
and the slab format (`slab/`) stores exactly the layers it calls Linear; a
layer one of them counted and the other did not would be a slab that does not
load, or a layer that streams from the wrong layout. This module imports
nothing of the package, so both may import it without importing each other.
"""

from __future__ import annotations

import torch.nn as nn


def is_conv1d(module: nn.Module) -> bool:
    """transformers' GPT-2 style Conv1D (y = x @ W + b, W stored [in, out]), or a subclass of it.

    Matched by class name and defining module along the MRO instead of an
    isinstance check, so transformers stays optional (no import), and a
    look-alike class named Conv1D from elsewhere (whose layout may differ) does
    not count.
    """
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers") for c in type(module).__mro__)


def is_adapter_path(name: str) -> bool:
    """A module path inside a peft adapter (lora_A / lora_B / lora_embedding_* / lora_magnitude_vector):
    Linears there belong to the adapter, not to the base model, so neither streams nor goes into a slab.
    (A live peft model is also recognised by its tuner layers, `blocks._adapter_module_names`; this is
    the rule for names alone, as a checkpoint or a slab has them.)"""
    return any(part.startswith("lora_") for part in name.split("."))
