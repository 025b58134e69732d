"""Build an INT8 slab streamed from a (sharded) safetensors checkpoint, never loading the model: every 2-D
floating ``{name}.weight`` counts as a Linear (``{name}.bias`` its bias), as in SquareQ's streaming builder."""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import torch

from torch_stagehand.runtime.linear_like import is_adapter_path

from torch_stagehand.runtime.slab.builder import LayerPlan, find_block_prefixes, write_slab
from torch_stagehand.runtime.slab.errors import SlabError, SlabMissingTensorError, SlabPathError
from torch_stagehand.runtime.slab.layers import canonical_name
from torch_stagehand.runtime.slab.report import BuildResult
from torch_stagehand.runtime.slab.safetensors_io import ST_DTYPES, byte_view, pread_into, read_header

_INDEX_PREFERENCE = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")


def _resolve_checkpoint(path) -> dict[str, str]:
    """tensor key -> shard file, from a directory, an index json or a single file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        idx = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if len(idx) > 1:
            idx = [f for f in _INDEX_PREFERENCE if f in idx] or idx
            if len(idx) > 1:
                raise SlabError(f"several index files, pass one: {idx}", path=path)
        if idx:
            path = os.path.join(path, idx[0])
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if len(files) != 1:
                raise SlabError(f"expected one *.safetensors.index.json or one *.safetensors, found {files}", path=path)
            path = os.path.join(path, files[0])
    if path.endswith(".json"):
        with open(path) as f:
            wmap = json.load(f).get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise SlabError("index has no weight_map", path=path)
        base = os.path.dirname(path)
        return {k: os.path.join(base, _shard_in_folder(path, k, v)) for k, v in wmap.items()}
    return {k: path for k in read_header(path).tensors}


def _shard_in_folder(index_path: str, key: str, shard) -> str:
    """A weight_map entry, checked to name a file inside the index's folder (a subfolder is fine):
    an absolute path or a '..' would make the build read a file elsewhere."""
    parts = shard.replace("\\", "/").split("/") if isinstance(shard, str) else []
    if not parts or os.path.isabs(shard) or any(p in ("", ".", "..") for p in parts) or "\0" in shard:
        raise SlabPathError(f"index field 'weight_map' maps {key!r} to {shard!r}: a shard must be a relative path "
                            "to a file inside the checkpoint's folder (no absolute path, no '..')", path=index_path)
    return shard


def build_slab_from_checkpoint(model_dir_or_index_json, output_dir, slab_name: str, architecture_id: str,
                               include_prefixes: Iterable[str] | None = None, pack_k: int = 64,
                               quantizer: str = "mse", blocks_only: bool = False, progress: bool = True, *,
                               conv1d_layers: Iterable[str] | Callable[[str], bool] | None = None,
                               compare_quantizers: bool = True, print_report: bool = True) -> BuildResult:
    """Stream a safetensors checkpoint (a directory with ``*.safetensors.index.json`` or one ``*.safetensors``, or
    the index / file path) into a slab, a few rows at a time with ``pread`` (no mmap): resident memory stays a few
    chunks whatever the checkpoint size. The slab and signature are `build_slab_from_module`'s on the same weights.
    Embeddings are 2-D too: exclude them with `include_prefixes` or `blocks_only`.

    blocks_only: keep only layers under the checkpoint's block lists (the prefixes before the first numeric segment
        that occur with >= 2 indices, e.g. ``model.layers.``), intersected with `include_prefixes`.
    conv1d_layers: canonical names (or a predicate) of transformers Conv1D layers, whose checkpoint weight is
        ``[in, out]``; such a layer is read whole (one tensor in memory) and transposed.
    """
    shards = _resolve_checkpoint(model_dir_or_index_json)
    headers = {f: read_header(f) for f in sorted(set(shards.values()))}
    infos = {}
    for key, f in shards.items():
        if key not in headers[f].tensors:
            raise SlabMissingTensorError(f"index lists tensor {key!r} but the shard does not hold it", path=f, layer=key)
        infos[key] = (f, headers[f].tensors[key])
    is_conv1d_name = conv1d_layers if callable(conv1d_layers) else (lambda s: lambda n: n in s)(set(conv1d_layers or ()))
    cand = {}
    for key, (f, t) in infos.items():
        if key.endswith(".weight") and len(t.shape) == 2 and t.dtype in ("F16", "BF16", "F32", "F64"):
            name = canonical_name(key[: -len(".weight")])
            if not is_adapter_path(name):
                cand[name] = key
    prefixes = None if include_prefixes is None else tuple(include_prefixes)
    if blocks_only:
        found = find_block_prefixes(cand)
        if prefixes is not None:  # intersected with include_prefixes
            found = [b for b in found if b.startswith(prefixes)] + [i for i in prefixes if i.startswith(found)]
        prefixes = tuple(sorted(set(found)))
        if not prefixes:
            raise SlabError("blocks_only: no block list found (no 'name.N.' keys with >= 2 indices)",
                            path=os.fspath(model_dir_or_index_json))
    fds: dict[str, int] = {}
    scratch = [torch.empty(0, dtype=torch.uint8)]  # one reused buffer for row chunks (of "slab_chunk_elements" at most)

    def read_range(f, t, start, nbytes, name, fresh=False) -> torch.Tensor:
        if not fresh and scratch[0].numel() < nbytes:
            scratch[0] = torch.empty(nbytes, dtype=torch.uint8)
        view = torch.empty(nbytes, dtype=torch.uint8) if fresh else scratch[0][:nbytes]
        if f not in fds:
            fds[f] = os.open(f, os.O_RDONLY)
        pread_into(fds[f], byte_view(view), start, f, name)
        return view.view(ST_DTYPES[t.dtype])

    def plan(name: str, key: str) -> LayerPlan:
        f, t = infos[key]
        conv, item, held = is_conv1d_name(name), ST_DTYPES[t.dtype].itemsize, {}
        out_f, in_f = (t.shape[1], t.shape[0]) if conv else t.shape
        bkey = key[: -len(".weight")] + ".bias"

        def get_rows(r0, r1):
            if not conv:
                return read_range(f, t, t.start + r0 * in_f * item, (r1 - r0) * in_f * item, name).view(r1 - r0, in_f)
            if "w" not in held:  # a Conv1D's rows are its columns: read whole, once
                held["w"] = read_range(f, t, t.start, t.nbytes, name, fresh=True).view(*t.shape)
            return held["w"][:, r0:r1].t().contiguous()

        def get_bias():
            bf, bt = infos[bkey]
            return read_range(bf, bt, bt.start, bt.nbytes, name, fresh=True)

        has_bias = bkey in infos and len(infos[bkey][1].shape) == 1
        return LayerPlan(name, out_f, in_f, has_bias, "conv1d" if conv else "linear", ST_DTYPES[t.dtype], get_rows,
                         get_bias if has_bias else None, held.clear)

    plans = [plan(name, key) for name, key in cand.items() if prefixes is None or name.startswith(prefixes)]
    try:
        return write_slab(plans, output_dir=output_dir, slab_name=slab_name, architecture_id=architecture_id,
                           pack_k=pack_k, quantizer=quantizer, signature_prefixes=prefixes, source="checkpoint",
                           progress=progress, compare_quantizers=compare_quantizers, print_report=print_report)
    finally:
        for fd in fds.values():
            os.close(fd)

