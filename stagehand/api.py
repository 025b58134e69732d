"""The front door: `offload` and `explain`."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from torch_stagehand.config import Config
from torch_stagehand.runtime.blocks import find_blocks, streamed_layers
from torch_stagehand.runtime.host_store import PRECISIONS
from torch_stagehand.runtime.runtime import PrecisionMapError, Runtime
from torch_stagehand.runtime.streamed import is_streamed

log = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def offload(
    model: nn.Module,
    device: str | torch.device | None = None,
    blocks: str | list[str] = "auto",
    precision: str | dict = "bf16",
    slab=None,
    config: Config | None = None,
) -> Runtime:
    """Stream the Linear weights of `model`'s blocks from host memory; keep the rest on `device`.

    precision: "bf16" (the weights as the model holds them), "int8", or a map
    {block index or block FQN: precision}; blocks the map leaves out get "bf16".
    slab: path to an INT8 slab (`{name}.manifest.json` or its directory + name)
    whose rows are read straight into the host store.
    """
    if any(is_streamed(m) for m in model.modules()):
        raise RuntimeError("offload: this model is already offloaded (call restore() on its Runtime first)")
    config = (config or Config()).validate()
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("offload: device='cuda' but CUDA is not available")
    block_fqns = find_blocks(model, blocks)
    layers = streamed_layers(model, block_fqns)
    precision_map = _initial_precision(precision, block_fqns)
    slab_loader = None
    if slab is not None:
        from torch_stagehand.runtime.slab_loading import slab_loader_for

        slab_loader = slab_loader_for(slab)
    rt = Runtime(model, device, block_fqns, layers, precision_map, config, slab_loader=slab_loader)
    log.info(
        "stagehand: %d blocks, %d streamed layers, %.1f MB host store, %d slots of %.1f MB on %s",
        len(block_fqns), len(layers), rt.store.host_bytes() / 1e6, len(rt.pool.slots), rt.pool.slot_bytes / 1e6, device,
    )
    return rt


def _initial_precision(precision, block_fqns: list[str]) -> dict[int, str]:
    if isinstance(precision, str):
        if precision not in PRECISIONS:
            raise PrecisionMapError(f"offload: unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
        return {b: precision for b in range(len(block_fqns))}
    if not isinstance(precision, dict):
        raise PrecisionMapError(f"offload: precision must be a string or a dict, got {type(precision).__name__}")
    result = {b: "bf16" for b in range(len(block_fqns))}
    for key, value in precision.items():
        if isinstance(key, str):
            if key not in block_fqns:
                raise PrecisionMapError(f"offload: precision map names block {key!r}, which is not a block")
            key = block_fqns.index(key)
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < len(block_fqns):
            raise PrecisionMapError(
                f"offload: precision map names block {key!r}; the model has blocks 0..{len(block_fqns) - 1}"
            )
        if value not in PRECISIONS:
            raise PrecisionMapError(f"offload: block {key} has unknown precision {value!r} (known: {', '.join(PRECISIONS)})")
        result[key] = value
    return result
