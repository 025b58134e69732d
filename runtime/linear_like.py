"""What counts as a Linear-like layer: `nn.Linear` and transformers' `Conv1D`.

One rule in one place: the streaming engine (`blocks.py`) and the slab format (`slab/`) must agree on which
layers are Linears. This module imports nothing of the package, so both may import it.
"""

from __future__ import annotations

import torch.nn as nn


def is_conv1d(module: nn.Module) -> bool:
    """transformers' GPT-2 style Conv1D (y = x @ W + b, W stored [in, out]), or a subclass of it: matched by name
    and module along the MRO, so transformers is not imported and a look-alike Conv1D from elsewhere does not count.
    """
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers") for c in type(module).__mro__)


def is_adapter_path(name: str) -> bool:
    """A module path inside a peft adapter (lora_A / lora_B / lora_embedding_* / lora_magnitude_vector):
    Linears there belong to the adapter, so neither streams nor goes into a slab (the rule for names alone, as a
    checkpoint or a slab has them; a live peft model is recognised by its tuner layers)."""
    return any(part.startswith("lora_") for part in name.split("."))
