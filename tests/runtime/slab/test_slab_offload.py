"""offload(model, slab=...): INT8 rows read from a slab file straight into the host store."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torch_stagehand as stagehand
from torch_stagehand.kernels import dequantize
from torch_stagehand.runtime.runtime import PrecisionMapError
from torch_stagehand.runtime.slab import SlabError, SlabReader, build_slab_from_module

from _helpers import ToyModel, assert_exact, rel_err, toy


@pytest.fixture
def slab(tmp_path):
    model, x = toy(n=3, d=64)
    result = build_slab_from_module(model, tmp_path, "toy_int8", "toy-v1", include_prefixes=("blocks.",),
                                    progress=False, print_report=False, compare_quantizers=False)
    return model, x, result.manifest_path


def _slab_reference(model: nn.Module, manifest: str) -> nn.Module:
    ref = copy.deepcopy(model)
    with SlabReader(manifest) as reader, torch.no_grad():
        for name, module in ref.named_modules():
            if name in reader.layers:
                q, s, _ = reader.read_layer(name)
                module.weight.copy_(dequantize(q, s).to(module.weight.dtype))
    return ref


def test_int8_from_slab_matches_the_slab_exactly(slab):
    model, x, manifest = slab
    ref = _slab_reference(model, manifest)(x)
    full_ref = copy.deepcopy(model)(x)
    rt = stagehand.offload(model, device="cpu", precision="int8", slab=manifest)
    with SlabReader(manifest) as reader:
        q, s, _ = reader.read_layer("blocks.1.up")
    q_host, s_host = rt.store.buffer(1, "int8"), rt.store.layout(1, "int8")[0]
    from torch_stagehand.runtime.precision import layer_views

    qv, sv = layer_views(q_host, s_host)
    assert torch.equal(qv, q) and torch.equal(sv, s)  # bytes straight from the file
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    with torch.no_grad():
        assert rel_err(compiled(x), ref) < 9e-7  # measured 3.4e-7 (CPU, torch 2.13, 3 seeds)
    rt.set_precision("bf16")  # the live model also has its full-precision weights
    with torch.no_grad():
        assert_exact(compiled(x), full_ref)  # measured 0 (CPU, torch 2.13, 3 seeds): the model's own weights and ops


def test_meta_model_streams_int8_only_from_the_slab(slab):
    model, x, manifest = slab
    ref = _slab_reference(model, manifest)(x)
    with torch.device("meta"):
        meta_model = ToyModel(64, 3)
    resident = {k: v for k, v in model.state_dict().items() if not (".up.weight" in k or ".down.weight" in k)}
    meta_model.load_state_dict(resident, strict=False, assign=True)
    meta_model.requires_grad_(False)
    rt = stagehand.offload(meta_model, device="cpu", precision="int8", slab=manifest)
    assert rt.store.blocks[0].full is None and rt.stats()["slot_bytes"] == rt.store.nbytes(0, "int8")
    with torch.no_grad():
        assert rel_err(meta_model(x), ref) < 9e-7  # measured 3.4e-7
    with pytest.raises(PrecisionMapError, match="no full-precision weights"):
        rt.set_precision({0: "bf16"})
    with pytest.raises(RuntimeError, match="INT8 slab only"):
        rt.restore()


def test_meta_model_without_slab_is_an_error():
    with torch.device("meta"):
        model = ToyModel(16, 3)
    with pytest.raises(RuntimeError, match="meta device and no slab"):
        stagehand.offload(model, device="cpu")


def test_slab_of_another_model_is_rejected_naming_the_layer(slab, tmp_path):
    _, _, manifest = slab
    other, _ = toy(n=3, d=32)
    with pytest.raises(SlabError, match=r"toy_int8.manifest.json: layer 'blocks\.0\.(up|down)'"):
        stagehand.offload(other, device="cpu", precision="int8", slab=manifest)
    assert type(other.blocks[0].up) is nn.Linear  # a failed load changes nothing
    with pytest.raises(FileNotFoundError):
        stagehand.offload(other, device="cpu", slab=tmp_path / "missing")


def test_int8_blocks_are_page_locked_by_the_reader_threads_as_their_rows_land(slab, monkeypatch):
    """Offload page-locks each block that streams INT8 as soon as its rows are in, on the reader thread that read
    the last of them (beside the reads still going, not after them all), once; a block that streams bf16 keeps its
    INT8 copy pageable, and its master is locked by `set_pins` on the calling thread."""
    import threading

    from torch_stagehand.runtime.host import arena as host_arena

    from _helpers import RecordingPinner

    model, _, manifest = slab
    by_thread = {}

    class ThreadPinner(RecordingPinner):
        def register(self, ptr, nbytes):
            by_thread[ptr] = threading.current_thread().name
            super().register(ptr, nbytes)

    fake = ThreadPinner()
    monkeypatch.setattr(host_arena, "pinner_for", lambda device, pin: fake)
    rt = stagehand.offload(model, device="cpu", precision={0: "bf16", 1: "int8", 2: "int8"}, slab=manifest,
                           keep_full="ram")
    int8 = {rt.store.buffer(b, "int8").data_ptr() for b in (1, 2)}
    master = rt.store.buffer(0, "bf16").data_ptr()
    assert set(fake.locked) == int8 | {master} and fake.calls == 3  # each range locked once
    assert all(by_thread[p].startswith("stagehand-slab-read") for p in int8)
    assert by_thread[master] == threading.main_thread().name
    rt.restore()


def test_a_non_zero_zero_point_is_refused_by_the_read_of_its_layer(slab):
    """Offload opens the slab without a pass over every zero point (a scattered read per layer before the first
    row); the read of each layer checks its own: a slab with one non-zero zero point still fails offload, naming
    the layer, and leaves the model as it was."""
    import json
    import pathlib
    import struct
    import zlib

    from torch_stagehand.runtime.slab import SlabUnsupportedError

    model, _, manifest = slab
    with SlabReader(manifest) as reader:
        info = reader.header.tensors["blocks.1.up.zero_point"]
        path = reader.path
    with open(path, "r+b") as f:  # a zero point of 3.0, with a checksum that matches it (as a SquareQ slab's would)
        f.seek(info.start + 8)
        f.write(struct.pack("<f", 3.0))
        f.seek(info.start)
        crc = zlib.crc32(f.read(info.end - info.start))
    with open(manifest) as f:
        doc = json.load(f)
    entry = next(e for e in doc["layers"] if e["canonical_name"] == "blocks.1.up")
    entry["stagehand"]["crc32"]["blocks.1.up.zero_point"] = f"{crc:08x}"
    pathlib.Path(manifest).write_text(json.dumps(doc))
    with pytest.raises(SlabUnsupportedError, match=r"layer 'blocks\.1\.up'.*zero_point is non-zero"):
        SlabReader(manifest)
    with SlabReader(manifest, check_zero_points=False) as reader:  # opens; the layer's read refuses it
        with pytest.raises(SlabUnsupportedError, match=r"layer 'blocks\.1\.up'.*zero_point is non-zero \(1 of"):
            reader.check_zero_points(threads=4)  # (offload's check beside the identity, when rows are read behind)
        reader.read_layer("blocks.0.up")
        with pytest.raises(SlabUnsupportedError, match="zero_point is non-zero"):
            reader.read_layer("blocks.1.up")
    with pytest.raises(SlabUnsupportedError, match=r"layer 'blocks\.1\.up'.*zero_point is non-zero"):
        stagehand.offload(model, device="cpu", precision="int8", slab=manifest)
    assert type(model.blocks[1].up) is nn.Linear  # a failed load changes nothing
