"""Slab identity (which weights a slab was quantized from) and slab paths confined to their folder.

Issue 12's rows: "offloads with a slab built from other weights of the same
shapes: accepted, INT8 blocks compute with the foreign weights" and "a slab
manifest whose safetensors_file is absolute or contains ../, an index
weight_map naming any path, slab_name='../x': reads or writes outside the
slab's folder". Real safetensors files, written under tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import torch_stagehand as stagehand
from torch_stagehand.config import Config, ConfigError
from torch_stagehand.runtime.slab import (
    SlabIdentityError,
    SlabIdentityWarning,
    SlabManifestError,
    SlabPathError,
    SlabReader,
    build_slab_from_checkpoint,
    build_slab_from_module,
    slab_paths,
)

from _helpers import ToyModel, int8_reference, rel_err, toy

QUIET = dict(progress=False, print_report=False, compare_quantizers=False)


def _build(model, out_dir, name="toy_int8"):
    return build_slab_from_module(model, out_dir, name, "toy-v1", include_prefixes=("blocks.",), **QUIET)


def _edit_manifest(path, fn):
    raw = json.load(open(path))
    fn(raw)
    json.dump(raw, open(path, "w"))


def _strip_identity(raw):
    for layer in raw["layers"]:
        layer["stagehand"].pop("identity")


@pytest.fixture
def slab(tmp_path):
    model, x = toy(n=3, d=64)
    return model, x, _build(model, tmp_path / "slab").manifest_path


# ── identity ─────────────────────────────────────────────────────────────


def test_slab_of_other_weights_is_refused_naming_the_first_layer(slab):
    _, x, manifest = slab
    other, _ = toy(n=3, d=64, seed=1)  # same shapes, other weights: the slab's signature matches
    with torch.no_grad():
        before = other(x)
    with pytest.raises(SlabIdentityError, match=r"toy_int8\.manifest\.json: layer 'blocks\.0\.up': the slab was "
                                                r"built from other weights"):
        stagehand.offload(other, device="cpu", precision="int8", slab=manifest)
    assert type(other.blocks[0].up) is nn.Linear
    with torch.no_grad():
        assert torch.equal(other(x), before)  # the refused load computed nothing with foreign weights
    # The model is usable: its own INT8 (built from its weights) gives the right number.
    ref = int8_reference(other, "int8")
    stagehand.offload(other, device="cpu", precision="int8")
    with torch.no_grad():
        assert rel_err(other(x), ref(x)) < 9e-7  # measured 3.4e-7 (CPU, torch 2.13, 3 seeds)


def test_own_slab_loads_and_computes_its_own_weights(slab):
    model, x, manifest = slab
    ref = int8_reference(model, "int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlabIdentityWarning)
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest)
    with torch.no_grad():
        assert rel_err(model(x), ref(x)) < 9e-7  # measured 3.4e-7


def test_an_edited_sampled_row_is_caught_in_that_layer(slab):
    model, _, manifest = slab
    with SlabReader(manifest) as reader:
        assert reader.check_identity(model) == 6  # every streamed layer checked
        rows = reader.layers["blocks.2.down"].identity["rows"]
        assert rows[0] == 0 and rows[-1] == 63 and len(rows) == 8
        with torch.no_grad():
            model.blocks[2].down.weight[rows[-1], 5] += 1e-3  # one element of one row
        with pytest.raises(SlabIdentityError, match=r"layer 'blocks\.2\.down'"):
            reader.check_identity(model)
        model.blocks[1].up = nn.Linear(64, 100)  # fewer rows than the source sampled: an error, not an IndexError
        with pytest.raises(SlabIdentityError, match=r"layer 'blocks\.1\.up'.*100 rows"):
            reader.check_identity(model)


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_cast_of_the_source_weights_is_the_same_identity(tmp_path, model_dtype):
    # A checkpoint saved in fp32 and loaded in another dtype is still the slab's source.
    model, _ = toy(n=3, d=64)
    manifest = _build(model, tmp_path / "slab").manifest_path
    cast = model.to(model_dtype)
    with SlabReader(manifest) as reader:
        assert reader.check_identity(cast) == 6
    other, _ = toy(n=3, d=64, seed=1)
    with SlabReader(manifest) as reader, pytest.raises(SlabIdentityError, match=r"blocks\.0\.up"):
        reader.check_identity(other.to(model_dtype))


def test_streamed_build_records_the_module_builds_identity(tmp_path):
    model, _ = toy(n=3, d=64, dtype=torch.bfloat16)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    a = _build(model, tmp_path / "a", "a")
    b = build_slab_from_checkpoint(ckpt, tmp_path / "b", "b", "toy-v1", include_prefixes=("blocks.",), **QUIET)
    assert {n: e.identity for n, e in a.manifest.layers.items()} == {n: e.identity for n, e in b.manifest.layers.items()}
    fp32 = model.float()  # the bf16 checkpoint loaded in fp32
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlabIdentityWarning)
        stagehand.offload(fp32, device="cpu", precision="int8", slab=b.manifest_path)


def test_slab_without_identity_warns_or_is_refused_when_required(slab):
    model, x, manifest = slab
    _edit_manifest(manifest, _strip_identity)  # as a slab built before identity was recorded
    with pytest.raises(SlabIdentityError, match=r"layer 'blocks\.0\.up': the slab records no identity .*6 of 6"):
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest,
                          config=Config(require_slab_identity=True))
    assert type(model.blocks[0].up) is nn.Linear
    ref = int8_reference(model, "int8")
    with pytest.warns(SlabIdentityWarning, match=r"toy_int8\.manifest\.json: layer 'blocks\.0\.up'.*cannot be checked"):
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest)
    with torch.no_grad():
        assert rel_err(model(x), ref(x)) < 9e-7  # measured 3.4e-7
    with pytest.raises(ConfigError, match="require_slab_identity"):
        Config(require_slab_identity="yes").validate()


def test_meta_model_has_nothing_to_check_and_loads_quietly(slab):
    model, x, manifest = slab
    with torch.device("meta"):
        meta_model = ToyModel(64, 3)
    resident = {k: v for k, v in model.state_dict().items() if not k.endswith(("up.weight", "down.weight"))}
    meta_model.load_state_dict(resident, strict=False, assign=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlabIdentityWarning)
        stagehand.offload(meta_model, device="cpu", precision="int8", slab=manifest,
                          config=Config(require_slab_identity=True))
    with torch.no_grad():
        assert rel_err(meta_model(x), int8_reference(model, "int8")(x)) < 9e-7  # measured 3.4e-7


@pytest.mark.parametrize("record, problem", [
    ("abc", "is str"),
    ({"scheme": "md5", "rows": [0], "sha256": {}}, "scheme is 'md5'"),
    ({"scheme": "sha256-sampled-rows-1", "rows": [0, 999], "sha256": {"float32": "0" * 64}}, "rows must be"),
    ({"scheme": "sha256-sampled-rows-1", "rows": [0], "sha256": {"float32": "x"}}, "sha256 must map"),
])
def test_malformed_identity_record_names_the_field(slab, record, problem):
    _, _, manifest = slab
    _edit_manifest(manifest, lambda raw: raw["layers"][1]["stagehand"].update(identity=record))
    with pytest.raises(SlabManifestError, match=rf"layer 'blocks\.0\.up': field 'stagehand\.identity' {problem}"):
        SlabReader(manifest)


def test_conv1d_layers_are_checked_in_their_linear_orientation(tmp_path):
    pu = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    model = nn.Module()
    model.h = nn.ModuleList(nn.ModuleDict({"c_attn": pu.Conv1D(120, 40)}) for _ in range(2))
    res = build_slab_from_module(model, tmp_path, "gpt", "gpt2", **QUIET)
    with SlabReader(res.manifest_path) as reader:
        assert reader.check_identity(model) == 2
        with torch.no_grad():
            model.h[1].c_attn.weight[:, 0] *= 2  # column 0 of the [in, out] weight: output row 0
        with pytest.raises(SlabIdentityError, match=r"layer 'h\.1\.c_attn'"):
            reader.check_identity(model)


# ── paths ────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("where", ["../outside.safetensors", "absolute", "sub/x.safetensors", ".."])
def test_manifest_cannot_point_outside_its_folder(slab, tmp_path, where):
    _, _, manifest = slab
    st = manifest[: -len(".manifest.json")] + ".safetensors"
    outside = tmp_path / "outside.safetensors"
    shutil.copy(st, outside)  # a readable slab outside the folder: it must not be read
    value = str(outside) if where == "absolute" else where
    _edit_manifest(manifest, lambda raw: raw["stagehand"].update(safetensors_file=value))
    msg = rf"toy_int8\.manifest\.json: field 'stagehand\.safetensors_file' is '{re.escape(value)}'.*bare file name"
    with pytest.raises(SlabPathError, match=msg):
        SlabReader(manifest)
    model, _ = toy(n=3, d=64)
    with pytest.raises(SlabPathError, match=msg):
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest)


def _checkpoint_with_index(tmp_path, shard_name):
    model, _ = toy(n=2, d=16)
    ckpt = tmp_path / "ckpt"
    target = ckpt / shard_name
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(target))
    return ckpt, {k: shard_name for k in model.state_dict()}


@pytest.mark.parametrize("shard", ["../elsewhere/model.safetensors", "absolute", "sub/../../x.safetensors"])
def test_index_weight_map_cannot_name_a_file_outside_the_checkpoint(tmp_path, shard):
    elsewhere = tmp_path / "elsewhere"
    ckpt, wmap = _checkpoint_with_index(tmp_path, "model.safetensors")
    elsewhere.mkdir()
    shutil.copy(ckpt / "model.safetensors", elsewhere / "model.safetensors")  # readable: must not be read
    value = str(elsewhere / "model.safetensors") if shard == "absolute" else shard
    json.dump({"weight_map": {k: value for k in wmap}}, open(ckpt / "model.safetensors.index.json", "w"))
    with pytest.raises(SlabPathError, match=rf"index\.json: index field 'weight_map' maps '.*' to '{re.escape(value)}'"):
        build_slab_from_checkpoint(ckpt, tmp_path / "out", "o", "toy", **QUIET)
    assert not (tmp_path / "out").exists()


def test_index_weight_map_may_name_a_subfolder(tmp_path):
    ckpt, wmap = _checkpoint_with_index(tmp_path, "shards/model-1.safetensors")
    json.dump({"weight_map": wmap}, open(ckpt / "model.safetensors.index.json", "w"))
    res = build_slab_from_checkpoint(ckpt, tmp_path / "out", "o", "toy", include_prefixes=("blocks.",), **QUIET)
    assert len(res.manifest.layers) == 4


@pytest.mark.parametrize("name", ["../x", "a/b", "/abs/x", "", "..", "a\\b"])
def test_slab_name_must_be_a_bare_file_name(tmp_path, name):
    model, _ = toy(n=2, d=16)
    out = tmp_path / "deep" / "out"
    with pytest.raises(SlabPathError, match=re.escape(f"slab_name is {name!r}")):
        build_slab_from_module(model, out, name, "toy", **QUIET)
    assert not (tmp_path / "deep").exists() and not os.path.exists(tmp_path / "x.safetensors")
    ckpt, _ = _checkpoint_with_index(tmp_path, "model.safetensors")
    with pytest.raises(SlabPathError, match="slab_name"):
        build_slab_from_checkpoint(ckpt, out, name, "toy", **QUIET)
    with pytest.raises(SlabPathError, match="slab_name"):
        slab_paths(out, name)
    assert not (tmp_path / "deep").exists()
