"""Offload's host side: plan the copies, check the machine, fill the host store (from the model or its file).
The preflight runs before any allocation, the model's weights are released block by block as the store fills, and
pinning comes last (`HostStore.set_pins`): locking commits pages.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn as nn

from torch_stagehand.runtime.host import arena as host_arena
from torch_stagehand.runtime.host import budget as host_budget
from torch_stagehand.runtime.host import copy as host_copy
from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.beside import run_beside
from torch_stagehand.runtime.blocks import StreamedLayerSpec
from torch_stagehand.runtime.host.plan import HostPlan, plan_host, preflight
from torch_stagehand.runtime.host.store import KEEP_FILE, HostStore
from torch_stagehand.runtime.telemetry.stage_clock import COMPILER_PREPARATION, StageClock
from torch_stagehand.runtime.host.weights_file import CheckpointError, WeightsFile

log = logging.getLogger(__name__)


def make_host_store(layers: list[StreamedLayerSpec], n_blocks: int, precision_map: dict[int, str], config,
                    device: torch.device, keep_full: str, checkpoint: WeightsFile | None,
                    from_slab: bool, node=None) -> tuple[HostStore, HostPlan]:
    """A planned, preflighted, still empty host store."""
    pinner = host_arena.pinner_for(device, config.pin_memory)
    has_master = [all(not s.weight.is_meta or (checkpoint is not None and s.weight_name in checkpoint)
                      for s in layers if s.block == b) for b in range(n_blocks)]
    freed = sum(s.weight.numel() * s.weight.element_size() for s in layers if s.weight.device.type == "cpu")
    machine = host_budget.probe_machine()
    training = tuple(sorted({s.block for s in layers if s.weight.requires_grad}))
    plan = plan_host(layers, n_blocks, precision_map, keep_full, pinner.locks, machine, has_master, freed,
                     has_file=checkpoint is not None, from_slab=from_slab,
                     int8_on_disk=from_slab and config.int8_tier == "disk", training_blocks=training)
    plan.node_ranks = 1 if node is None else node.local_size
    preflight(plan, machine, precision_map, has_file=checkpoint is not None)
    quant_device = device if device.type == "cuda" else None
    store = HostStore(layers, n_blocks, pin=pinner.locks, quantizer=config.quantizer, quant_device=quant_device,
                      pinner=pinner, keep_full=plan.keep_full, node=node)
    log.info("stagehand: host plan keep_full=%s, %s", plan.keep_full,
             ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in plan.bytes.items()))
    return store, plan


def missing_stack(store: HostStore, checkpoint: WeightsFile | None, block: int) -> str:
    """Why a checkpoint did not fill an expert stack: it stores the experts one by one, which offload does not fuse."""
    for spec in store.blocks[block].layers:
        if spec.experts and spec.weight.is_meta and checkpoint is not None and spec.weight_name not in checkpoint:
            return (f"; the checkpoint has no {spec.weight_name} (the fused {spec.experts}-expert stack): a checkpoint "
                    "that stores the experts one by one is not fused into stacks by offload yet, so build the "
                    "model with its weights (from_pretrained) and offload it from memory")
    return ""


def fill_masters(store: HostStore, checkpoint: WeightsFile | None, progress,
                 while_filling: Callable[[], None] | None = None, clock: StageClock | None = None) -> list[int]:
    """Masters into the store (flat buffers, or views of the file); returns the blocks with none (meta, no file).
    The copies run on a worker thread while `while_filling()` runs on this one (views of a mapped file take no
    time: `while_filling()` then runs after them)."""
    if store.keep_full == KEEP_FILE:
        store.after_file_read = checkpoint.release_pages
        for b in progress(range(len(store.blocks)), "offload: blocks mapped from the checkpoint"):
            store.adopt_file(b, [_file_weight(checkpoint, spec, keep_in_file=True) for spec in store.blocks[b].layers])
        if while_filling is not None:
            while_filling()
        return []
    seconds: dict[str, float] = {}
    missing = run_beside(lambda: _copy_masters(store, checkpoint, progress), while_filling,
                         "stagehand-masters", seconds)
    if clock is not None and while_filling is not None:
        clock.beside("masters copied", seconds["work"])
        clock.beside(COMPILER_PREPARATION, seconds["calling thread"])
    return missing


def _copy_masters(store: HostStore, checkpoint: WeightsFile | None, progress) -> list[int]:
    """Each block's weights (the model's, or the checkpoint's) copied into the store's flat buffers."""

    def source(spec: StreamedLayerSpec) -> torch.Tensor | None:
        w = spec.weight
        if not w.is_meta:
            return w.detach()
        if checkpoint is not None and spec.weight_name in checkpoint:
            return _file_weight(checkpoint, spec)
        return None

    with_master = [b for b, bb in enumerate(store.blocks) if all(source(spec) is not None for spec in bb.layers)]
    store.reserve(precisions.FULL, with_master)
    missing = []
    for b in progress(range(len(store.blocks)), "offload: blocks to the host store"):
        if b not in with_master or not store.adopt_full(b, source):
            missing.append(b)
        elif checkpoint is not None:
            checkpoint.release_pages()  # the block's file pages were copied: out of our RSS
    host_copy.release()  # a model on the GPU came through the pinned bounce buffer
    return missing


def _file_weight(checkpoint: WeightsFile, spec: StreamedLayerSpec, keep_in_file: bool = False) -> torch.Tensor:
    """The layer's weight in the file (the module's own layout); copied into the store unless kept in the file."""
    w, name = spec.weight, spec.weight_name
    t = checkpoint.tensor_for(name, w, "weight", track=keep_in_file)
    if keep_in_file and t.dtype != w.dtype:
        raise CheckpointError(f"checkpoint {checkpoint.path!r}: {name} is {t.dtype}, the model's weight {w.dtype}; "
                              "keep_full='file' streams the file's tensors as they are (save the checkpoint in "
                              f"{w.dtype}, or keep_full='ram')")
    if keep_in_file and not w.is_meta and not torch.equal(t, w.detach().cpu()):
        raise CheckpointError(f"checkpoint {checkpoint.path!r}: {name} differs from the model's weight; "
                              "keep_full='file' must be given the file the model's weights came from")
    return t


def load_resident(model: nn.Module, checkpoint: WeightsFile, device: torch.device, streamed: set[str],
                  progress) -> None:
    """Every meta parameter and buffer that is not a streamed weight, from the file, straight to `device`. Tied
    parameters stay tied: each object is replaced once, everywhere it is registered."""
    owners = _resident_owners(model, streamed)
    untied = []
    for entries in progress(list(owners.values()), "offload: resident tensors from the checkpoint"):
        found = next((e[3] for e in entries if e[3] in checkpoint), None)
        if found is None:
            untied.append(entries)  # e.g. a tied lm_head the file stores once, under the embedding's name
            continue
        t = entries[0][4]
        value = checkpoint.tensor_for(found, t, "tensor").to(device=device, dtype=t.dtype, copy=True)
        if entries[0][1] == "_parameters":
            value = nn.Parameter(value, requires_grad=t.requires_grad)
        for module, kind, name, *_ in entries:
            getattr(module, kind)[name] = value
    if untied and hasattr(model, "tie_weights"):  # transformers ties weights the file holds once
        model.tie_weights()
    for entries in untied:
        module, kind, name, fqn, _ = entries[0]
        if getattr(module, kind)[name] is None or getattr(module, kind)[name].is_meta:
            raise CheckpointError(f"checkpoint {checkpoint.path!r} has no tensor for {fqn} (a meta "
                                  f"{'parameter' if kind == '_parameters' else 'buffer'} of the model); build the "
                                  "model with its buffers real (accelerate.init_empty_weights()) from the "
                                  "checkpoint's own config")
    checkpoint.release_pages()


def resident_file_names(model: nn.Module, checkpoint: WeightsFile, streamed: set[str]) -> list[str]:
    """The checkpoint's names of the tensors `load_resident` will read (to read their pages ahead)."""
    names = (next((e[3] for e in entries if e[3] in checkpoint), None)
             for entries in _resident_owners(model, streamed).values())
    return [name for name in names if name is not None]


def _resident_owners(model: nn.Module, streamed: set[str]) -> dict[int, list[tuple]]:
    """Every meta parameter and buffer not in `streamed`, by tensor: id(tensor) -> its registrations
    (module, "_parameters" | "_buffers", name, fqn, tensor)."""
    owners: dict[int, list[tuple]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                fqn = f"{mod_name}.{name}" if mod_name else name
                if t is not None and t.is_meta and fqn not in streamed:
                    owners.setdefault(id(t), []).append((module, kind, name, fqn, t))
    return owners
