"""What a slab is checked against when it opens, and a live model against a slab: the checks that need the
manifest, the parsed header and the file's size, never the tensor bytes (those are `SlabReader`'s)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import hashlib
import os
import warnings
from typing import Iterable

import torch
from torch import nn

from torch_stagehand.runtime.slab import identity
from torch_stagehand.runtime.slab.errors import (
    SlabChecksumError, SlabDtypeError, SlabExtraTensorError, SlabIdentityError, SlabIdentityWarning,
    SlabMismatchError, SlabMissingTensorError, SlabModelMismatchError, SlabShapeError, SlabSignatureError,
    SlabTruncatedError,
)
from torch_stagehand.runtime.slab.layers import compute_model_signature, iter_linear_layers, signature_from_shapes
from torch_stagehand.runtime.slab.manifest import SLAB_ID_KEY, SlabManifest
from torch_stagehand.runtime.slab.safetensors_io import MANIFEST_DTYPE_TO_TAG, SafetensorsHeader


def check_slab_id(manifest: SlabManifest, header: SafetensorsHeader, manifest_path: str, path: str) -> None:
    """Manifest and file name the same slab (ours only); first, so another slab's manifest reads as that."""
    want_id = (manifest.stagehand or {}).get("slab_id")
    got_id = header.metadata.get(SLAB_ID_KEY)
    if want_id and want_id != got_id:
        raise SlabMismatchError(f"the manifest {manifest_path} describes slab {want_id}, but this file is slab "
                                f"{got_id or '<no slab id>'}: manifest and slab file do not belong together", path=path)


def check_tensors(manifest: SlabManifest, header: SafetensorsHeader, manifest_path: str, path: str) -> None:
    """Every listed tensor present with the right dtype and shape, no tensor the manifest does not list."""
    claimed: set[str] = set()
    for e in manifest.layers.values():
        for key, dtype, shape in e.tensor_specs():
            info = header.tensors.get(key)
            if info is None:
                raise SlabMissingTensorError(f"tensor {key!r} listed in the manifest is not in the file",
                                             path=path, layer=e.name)
            if info.dtype != MANIFEST_DTYPE_TO_TAG.get(dtype):
                raise SlabDtypeError(f"tensor {key!r} is {info.dtype} in the file, the manifest says {dtype}",
                                     path=path, layer=e.name)
            if info.shape != shape:
                raise SlabShapeError(f"tensor {key!r} is {list(info.shape)} in the file, the manifest says "
                                     f"{list(shape)}", path=path, layer=e.name)
            claimed.add(key)
    extra = sorted(set(header.tensors) - claimed)
    if extra:
        key = extra[0]
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise SlabExtraTensorError(f"tensor {key!r} is in the file but not in the manifest {manifest_path}{more}",
                                   path=path, layer=key.rsplit(".", 1)[0])


def check_file_identity(manifest: SlabManifest, header: SafetensorsHeader, size: int, manifest_path: str,
                        path: str) -> None:
    """The file is as long as its header says; ours: the header's sha256 and size the manifest records."""
    h, sh = header, manifest.stagehand
    if size != h.data_end:
        raise SlabTruncatedError(f"file has {size - h.data_end} bytes after the last tensor", path=path)
    if sh is None:
        return
    want = sh.get("header_sha256")
    if want is not None and hashlib.sha256(h.header_bytes).hexdigest() != want:
        raise SlabChecksumError(f"safetensors header sha256 differs from the one recorded in {manifest_path}",
                                path=path)
    want = sh.get("safetensors_bytes")
    if want is not None and want != size:
        raise SlabTruncatedError(f"file is {size} bytes, the manifest {manifest_path} recorded {want}", path=path)


def check_own_signature(manifest: SlabManifest, manifest_path: str) -> None:
    # Our builders sign exactly the layers they write: an edited layer list (or a pasted signature) shows here.
    if manifest.stagehand is None:
        return
    mine = signature_from_shapes((e.name, e.in_features, e.out_features, e.has_bias) for e in manifest.layers.values())
    if mine != manifest.model_signature:
        raise SlabSignatureError(f"model_signature {manifest.model_signature!r} does not match the manifest's own "
                                 f"layer list (which signs as {mine!r}): the manifest was edited or mixed up",
                                 path=manifest_path)


def check_model(manifest: SlabManifest, model: nn.Module, include_prefixes: Iterable[str] | None,
                where: str | os.PathLike) -> dict[str, nn.Module]:
    """`SlabReader.check_model` (the public entry): canonical name -> live module."""
    layers = manifest.layers
    scope = tuple(include_prefixes) if include_prefixes is not None else manifest.signature_prefixes
    live = {li.name: li for li in iter_linear_layers(model)}
    for e in layers.values():
        li = live.get(e.name)
        if li is None:
            raise SlabModelMismatchError("the model has no Linear layer of this name", path=where, layer=e.name)
        mine, slab = [li.out_features, li.in_features], [e.out_features, e.in_features]
        for differs, message in (
                (mine != slab, f"model has [out, in] = {mine}, slab has {slab}"),
                (li.has_bias != e.has_bias, f"model has_bias={li.has_bias}, slab has_bias={e.has_bias}"),
                (li.layout != e.source_layout, f"model layer is {li.layout}, slab was built from {e.source_layout}")):
            if differs:
                raise SlabModelMismatchError(message, path=where, layer=e.name)
    if manifest.stagehand is not None or include_prefixes is not None:
        for name in sorted(live):
            if name not in layers and (scope is None or name.startswith(scope)):
                raise SlabModelMismatchError("the model has this Linear layer but the slab does not",
                                             path=where, layer=name)
    sig = compute_model_signature(model, scope)
    if sig != manifest.model_signature:
        raise SlabSignatureError(
            f"model signature {sig!r} (prefixes {list(scope) if scope else None}) differs from the "
            f"manifest's {manifest.model_signature!r}", path=where)
    return {name: live[name].module for name in layers}


def check_identity(manifest: SlabManifest, weights: Iterable[tuple[str, torch.Tensor]], where: str,
                   require: bool = False) -> int:
    """Check live weights against the identity the slab records; returns the layers checked. `weights`: (canonical
    name, ``[out, in]`` weight) in the model's order, without meta weights and layers the slab lacks. Raises
    SlabIdentityError naming the first layer whose weights are not the slab's source. A layer with no identity
    recorded (an older or SquareQ slab, an unhashed dtype): SlabIdentityError when `require`, else one
    SlabIdentityWarning naming the file and the layers."""
    weights = list(weights)
    # On threads: mapped weights may read their sampled rows from the disk (the reads release the GIL); results
    # come back in the model's order, so the first layer that fails is the one named.
    with ThreadPoolExecutor(max(1, min(8, len(weights))), thread_name_prefix="stagehand-identity") as pool:
        results = list(pool.map(lambda nw: identity.check_layer(nw[0], manifest.layers[nw[0]].identity, nw[1], where),
                                weights))
    unchecked = [(name, str(w.dtype).replace("torch.", "")) for (name, w), ok in zip(weights, results) if not ok]
    checked = len(weights) - len(unchecked)
    if not unchecked:
        return checked
    name, dtype = unchecked[0]
    why = ("records no identity of its source weights for it" if manifest.layers[name].identity is None
           else f"records no identity for {dtype} weights")
    message = (f"the slab {why} ({len(unchecked)} of {checked + len(unchecked)} layers cannot be checked), "
               "so it cannot be told apart from a slab of other weights; rebuild it with this stagehand")
    if require:
        raise SlabIdentityError(message + " or leave Config.require_slab_identity False", path=where, layer=name)
    warnings.warn(f"{where}: layer '{name}': {message}; Config(require_slab_identity=True) refuses such slabs",
                  SlabIdentityWarning, stacklevel=3)
    return checked
