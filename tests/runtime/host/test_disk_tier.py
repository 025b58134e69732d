"""Config(int8_tier="disk"): INT8 blocks stream from the slab file through a small staging ring (issue 13).

The model is offloaded twice from the same slab, once with the INT8 rows read
into RAM and once with them left in the file: every output and gradient must
be the same bits, no INT8 copy may be in RAM, and the worker's read-ahead must
have served fetches before they were asked for.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.runtime.host import budget as host_budget
from torch_stagehand.runtime.host.budget import MachineMemory
from torch_stagehand.runtime.host.plan import HostMemoryError
from torch_stagehand.runtime.slab import build_slab_from_module

from _helpers import page_locked, rel_err, toy

DISK = stagehand.Config(int8_tier="disk")


@pytest.fixture(scope="module")
def slab(tmp_path_factory):
    model, x = toy(n=6)
    out = tmp_path_factory.mktemp("slab")
    result = build_slab_from_module(model, str(out), "toy", "toy", include_prefixes=("blocks.",), print_report=False)
    return model, x, result.manifest_path


def _train_step(fn, model, x):
    x = x.clone().requires_grad_(True)
    out = fn(x)
    out.square().mean().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_streaming_from_the_slab_file_equals_the_slab_in_ram(slab, compiled):
    source, x, manifest = slab
    in_ram, on_disk = copy.deepcopy(source), copy.deepcopy(source)
    stagehand.offload(in_ram, device="cpu", precision="int8", slab=manifest)
    rt = stagehand.offload(on_disk, device="cpu", precision="int8", slab=manifest, config=DISK)
    assert all(not bb.buffers.get("int8") for bb in rt.store.blocks)  # no INT8 copy in RAM
    kinds = rt.stats()["host"]["bytes_by_kind"]
    assert kinds["int8 disk"] == sum(rt.store.nbytes(b, "int8") for b in range(6)) and "int8 ram" not in kinds
    run = on_disk
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(on_disk, backend="stagehand", options={"inner": "eager"})
    for _ in range(2):
        want, got = _train_step(in_ram, in_ram, x), _train_step(run, on_disk, x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    tier = rt.stats()["host"]["disk_tier"]
    assert tier["reads"] >= 6 and tier["bytes_read"] >= kinds["int8 disk"]
    assert tier["ready"] > 0  # the worker had read blocks before they were fetched


def test_a_meta_model_streams_int8_from_the_disk_only(slab):
    source, x, manifest = slab
    meta = copy.deepcopy(source)
    for block in meta.blocks:
        block.up.to("meta"), block.down.to("meta")
    reference = copy.deepcopy(source)
    stagehand.offload(reference, device="cpu", precision="int8", slab=manifest)
    rt = stagehand.offload(meta, device="cpu", precision="int8", slab=manifest, config=DISK)
    assert rt.store.host_bytes() == 0
    with torch.no_grad():
        assert torch.equal(meta(x), reference(x))


def test_restore_stops_the_reader_thread(slab):
    source, x, manifest = slab
    model = copy.deepcopy(source)
    rt = stagehand.offload(model, device="cpu", precision="int8", slab=manifest, config=DISK)
    with torch.no_grad():
        model(x)
    workers = [t for t in threading.enumerate() if t.name.startswith("stagehand-disk")]
    mine = set(rt.store.disk_tier._pool._threads)
    assert mine and mine <= set(workers)
    rt.restore()
    assert not any(t.is_alive() for t in mine)
    assert torch.equal(model.blocks[0].up.weight, source.blocks[0].up.weight)


def test_the_preflight_does_not_count_int8_on_disk_as_ram(slab, monkeypatch):
    source, _, manifest = slab
    int8 = 6 * (64 * 32 + 4 * 64 + 32 * 64 + 4 * 32)
    fake = MachineMemory(total_bytes=2**30, available_bytes=int8 * 3 // 4)
    monkeypatch.setattr(host_budget, "probe_machine", lambda: fake)
    meta = copy.deepcopy(source)
    for block in meta.blocks:
        block.up.to("meta"), block.down.to("meta")
    with pytest.raises(HostMemoryError, match="int8 ram"):
        stagehand.offload(copy.deepcopy(meta), device="cpu", precision="int8", slab=manifest)
    rt = stagehand.offload(meta, device="cpu", precision="int8", slab=manifest, config=DISK)
    assert rt.stats()["host"]["bytes_by_kind"]["int8 disk"] > fake.available_bytes


def test_int8_tier_is_a_config_field_checked_by_name():
    from torch_stagehand.runtime.config import ConfigError

    with pytest.raises(ConfigError, match="int8_tier: must be"):
        stagehand.Config(int8_tier="nvme").validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_disk_tier_trains_like_the_slab_in_ram(tmp_path):
    model, x = toy(d=512, n=6, dtype=torch.bfloat16)
    result = build_slab_from_module(model, str(tmp_path), "toy", "toy", include_prefixes=("blocks.",),
                                    print_report=False, compare_quantizers=False, progress=False)
    in_ram, on_disk = copy.deepcopy(model), copy.deepcopy(model)
    stagehand.offload(in_ram, device="cuda", precision="int8", slab=result.manifest_path)
    rt = stagehand.offload(on_disk, device="cuda", precision="int8", slab=result.manifest_path, config=DISK)
    assert all(page_locked(s.view) for s in rt.store.disk_tier.ring)
    torch._dynamo.reset()
    reference, compiled = (torch.compile(m, backend="stagehand") for m in (in_ram, on_disk))
    for _ in range(3):  # the staging ring is reused many times over (6 blocks, 3 buffers, forward and backward)
        want, got = _train_step(reference, in_ram, x.cuda()), _train_step(compiled, on_disk, x.cuda())
        torch.cuda.synchronize()
        # the same program on the same bytes; a stale or half-read staging buffer would be far off
        assert rel_err(got[0], want[0]) < 1e-3 and rel_err(got[1], want[1]) < 1e-3
    assert rt.stats()["host"]["disk_tier"]["reads"] >= 12
