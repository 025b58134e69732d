"""DistributedDataParallel and FSDP2 over an offloaded model: both leave the streamed weights alone.

DDP would broadcast every streamed weight from rank 0 and refuse parameters on two device types: offload fills its
ignore list, and `Runtime.prepare_ddp(module)` for a wrapper built later (a peft model, whose names differ). A
streamed weight's gradient reaches the host by the runtime's own lane (train/grads.py), not the accumulation DDP
hooks. FSDP2 takes them in `ignored_params` (`Runtime.streamed_parameters()`); one it sharded anyway is refused."""

from __future__ import annotations

from typing import Callable

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from torch_stagehand.runtime.streamed import ShardedStreamedWeightError, is_dtensor, sharded_message


def ignore_streamed(module: nn.Module, layers) -> Callable[[], None]:
    """Add `module`'s streamed weights (under its own names) to DDP's ignore list; returns the undo."""
    ignored = {id(spec.weight) for spec in layers}
    names = [name for name, p in module.named_parameters(remove_duplicate=False) if id(p) in ignored]
    # Not getattr: a peft model forwards unknown attributes to the model it wraps, whose names differ.
    known = list(module.__dict__.get("_ddp_params_and_buffers_to_ignore", ()))
    had = "_ddp_params_and_buffers_to_ignore" in module.__dict__
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, known + [n for n in names if n not in known])

    def put_back() -> None:
        if had:
            module.__dict__["_ddp_params_and_buffers_to_ignore"] = known
        else:
            module.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)

    return put_back


def check_not_sharded(layers) -> None:
    """Refuse a streamed weight that FSDP2 turned into a sharded DTensor, naming it and the way out."""
    for spec in layers:
        if is_dtensor(spec.module._parameters.get(spec.param)):
            raise ShardedStreamedWeightError(sharded_message(spec.weight_name))
