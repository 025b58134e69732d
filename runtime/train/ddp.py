"""DistributedDataParallel and FSDP2 over an offloaded model: both leave the streamed weights alone.

Left to itself DDP would broadcast every parameter from rank 0 when it is built (the streamed weights too:
gigabytes copied over the host store of every rank, the same values each rank has already) and refuse a module
whose parameters sit on two device types (the streamed weights are on the host, the rest on the GPU). Its
documented way out is the module's ignore list (`_set_params_and_buffers_to_ignore_for_model`): offload fills
it for the model it offloads, and `Runtime.prepare_ddp(module)` for a wrapper built after offload (a peft model
made from the offloaded one), whose parameter names differ.

FSDP2 (`fully_shard`) takes them in its `ignored_params` (`Runtime.streamed_parameters()`): it then shards the
rest (embeddings, heads, norms, adapters) while the blocks stream. A streamed weight it sharded anyway would be
kept on the device in shards, all-gathered at every forward and stepped as FSDP's copy, not the host master:
fully_shard's assignment of it is refused (streamed.py), and `check_not_sharded` checks again at the first graph
or eager call.

A streamed weight that trains is ignored by DDP too: its gradient reaches the host by the runtime's own lane (train/grads.py),
not by autograd's accumulation that DDP hooks, and on several ranks the runtime sums it into its block's owner
(train/shards.py).
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from torch_stagehand.runtime.streamed import ShardedStreamedWeightError, is_dtensor, sharded_message


def ignore_streamed(module: nn.Module, layers) -> Callable[[], None]:
    """Add the streamed weights of `module` (by identity, under `module`'s own names) to DDP's ignore list;
    returns what puts the list back as it was (the runtime's close)."""
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
