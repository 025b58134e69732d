"""Host memory (issue 13): exact pinning, only what streams pinned, where masters are kept, preflight.

On the CPU nothing is page-locked, so a `RecordingPinner` stands in for
cudaHostRegister: it records the ranges offload would lock, and the same
arena code (one allocation per copy kind, page-aligned per-block views) runs.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.kernels import quantize_per_row
from torch_stagehand.runtime.host import arena as host_arena
from torch_stagehand.runtime.host import budget as host_budget
from torch_stagehand.runtime.host.arena import PAGE, page_round
from torch_stagehand.runtime.host.budget import MachineMemory
from torch_stagehand.runtime.config import ConfigError
from torch_stagehand.runtime.host.plan import HostMemoryError
from torch_stagehand.runtime.host.store import HostStore
from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.host.weights_file import CheckpointError

from _helpers import RecordingPinner, int8_reference, page_locked, rel_err, saved_checkpoint, toy

GiB = 2**30


@pytest.fixture
def pinner(monkeypatch):
    fake = RecordingPinner()
    monkeypatch.setattr(host_arena, "pinner_for", lambda device, pin: fake)
    return fake


def _ranges(rt):
    """(start pointer, bytes, block, precision) of every host buffer."""
    return [(buf.data_ptr(), buf.numel(), b, p) for b, bb in enumerate(rt.store.blocks) for p, buf in bb.buffers.items()]


def _locked(rt):
    return {(b, p) for ptr, n, b, p in _ranges(rt) if ptr in {a for arena in rt.store.arenas for a in arena.locked}}


def test_one_allocation_per_copy_kind_page_aligned_views_no_overlap(pinner):
    model, x = toy(n=4)
    weights = [model.blocks[b].up.weight.detach().clone() for b in range(4)]
    rt = stagehand.offload(model, device="cpu", precision="int8")
    assert len(rt.store.arenas) == 2  # bf16 masters, int8 copies: never one allocation per block
    spans = sorted((ptr, ptr + n) for ptr, n, *_ in _ranges(rt))
    assert all(start % PAGE == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "two block buffers overlap"
    for b in range(4):  # the modules' weights are views of the master buffers, with the model's values
        assert torch.equal(model.blocks[b].up.weight, weights[b])
        q, s = quantize_per_row(weights[b])
        lay = rt.store.layout(b, "int8")[0]
        assert torch.equal(rt.store.buffer(b, "int8")[lay.offset: lay.offset + q.numel()].view(torch.int8), q.flatten())
    with torch.no_grad():
        # measured 2.3e-7 (CPU, torch 2.13, 3 seeds)
        assert rel_err(model(x), int8_reference(toy(n=4)[0], "int8")(x)) < 6e-7


def test_only_the_streamed_copies_are_locked_at_their_exact_size(pinner):
    model, _ = toy(n=4)
    rt = stagehand.offload(model, device="cpu", precision="int8", keep_full="ram")
    assert _locked(rt) == {(b, "int8") for b in range(4)}  # the bf16 masters stay pageable
    host = rt.stats()["host"]
    int8 = sum(rt.store.nbytes(b, "int8") for b in range(4))
    assert host["pinned_requested_bytes"] == int8
    assert host["pinned_locked_bytes"] == sum(page_round(rt.store.nbytes(b, "int8")) for b in range(4))
    assert sorted(pinner.locked.values()) == sorted(page_round(rt.store.nbytes(b, "int8")) for b in range(4))
    assert host["bytes_by_kind"] == {"bf16 ram": sum(rt.store.nbytes(b, "bf16") for b in range(4)), "int8 pinned": int8}


def test_a_precision_switch_moves_the_lock_to_what_now_streams(pinner):
    model, x = toy(n=4)
    rt = stagehand.offload(model, device="cpu", precision="int8", keep_full="ram")
    rt.set_precision({1: "bf16"})
    assert _locked(rt) == {(0, "int8"), (1, "bf16"), (2, "int8"), (3, "int8")}
    rt.set_precision({1: "int8"})
    assert _locked(rt) == {(b, "int8") for b in range(4)}


def test_a_switch_of_many_blocks_waits_for_the_copies_in_flight_once(pinner):
    model, _ = toy(n=4)
    rt = stagehand.offload(model, device="cpu", precision="int8", keep_full="ram")
    drains, unlocked = pinner.drains, len(pinner.unlocked)
    rt.set_precision({0: "bf16", 1: "bf16", 2: "bf16"})
    assert len(pinner.unlocked) - unlocked == 3  # three INT8 ranges lose their lock...
    assert pinner.drains - drains == 1  # ...after one device synchronisation, not one per block
    assert _locked(rt) == {(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "int8")}


def test_a_build_on_the_gpu_reads_a_locked_master_and_then_locks_only_what_streams(monkeypatch, pinner):
    """Quantized on the GPU (the CPU stands in for it here), each block's master is page-locked before it goes up
    (at the link's speed, not staged by the driver) and unlocked once its block is built, its new int8 buffer is
    not (locking commits fresh pages slowly; the rows come down through the bounce buffer); after offload only
    what streams stays locked, and the bytes are the quantizer's."""
    store_init = HostStore.__init__

    def on_the_quantizing_device(self, *args, **kwargs):
        store_init(self, *args, **kwargs)
        self.quant_device = torch.device("cpu")

    monkeypatch.setattr(HostStore, "__init__", on_the_quantizing_device)
    int8 = type(precisions.get("int8"))
    int8_write, writes = int8.write, []

    def write(self, buf, lay, weight, quantizer):
        writes.append((buf.data_ptr() in pinner.locked, weight.untyped_storage().data_ptr() in pinner.locked,
                       len(pinner.locked)))
        int8_write(self, buf, lay, weight, quantizer)

    monkeypatch.setattr(int8, "write", write)
    model, _ = toy(n=4)
    weights = [model.blocks[b].up.weight.detach().clone() for b in range(4)]
    rt = stagehand.offload(model, device="cpu", precision="int8", keep_full="ram")
    assert len(writes) == 8 and all(master and not dst for dst, master, _ in writes)  # 2 Linears x 4 blocks
    assert all(n == 1 for *_, n in writes)  # one master locked at a time: each unlocked once its block is built
    assert _locked(rt) == {(b, "int8") for b in range(4)}  # the masters were unlocked again
    assert len(pinner.unlocked) == 4
    for b in range(4):
        q, _ = quantize_per_row(weights[b])
        lay = rt.store.layout(b, "int8")[0]
        assert torch.equal(rt.store.buffer(b, "int8")[lay.offset: lay.offset + q.numel()].view(torch.int8), q.flatten())


def test_keep_full_pinned_locks_the_masters_too(pinner):
    model, _ = toy(n=3)
    rt = stagehand.offload(model, device="cpu", precision="int8", keep_full="pinned")
    assert _locked(rt) == {(b, p) for b in range(3) for p in ("bf16", "int8")}
    assert set(rt.stats()["host"]["bytes_by_kind"]) == {"bf16 pinned", "int8 pinned"}


def test_restore_unlocks_and_frees_the_host_store_while_the_runtime_lives(pinner):
    model, x = toy(n=4)
    rt = stagehand.offload(model, device="cpu", precision={0: "bf16", 1: "int8"})
    with torch.no_grad():
        model(x)
    buffers = [weakref.ref(buf) for bb in rt.store.blocks for buf in bb.buffers.values()]
    arenas = [weakref.ref(a.base) for a in rt.store.arenas]
    assert pinner.locked
    rt.restore()
    gc.collect()
    assert pinner.locked == {}
    assert all(r() is None for r in buffers + arenas), "a host buffer outlived restore()"
    assert rt.stats()["host"]["pinned_locked_bytes"] == 0


def test_a_failed_offload_unlocks_what_it_locked(monkeypatch, pinner):
    model, _ = toy(n=3)

    def pool(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr("torch_stagehand.runtime.conductor.driver.SlotPool", pool)
    with pytest.raises(torch.OutOfMemoryError):
        stagehand.offload(model, device="cpu", precision="int8")
    assert pinner.calls >= 3 and pinner.locked == {}


# ---- keep_full="file" ---------------------------------------------------------------------------------


def test_keep_full_file_keeps_no_master_in_ram_and_computes_the_same(tmp_path, pinner):
    model, x = toy(n=4)
    plain = toy(n=4)[0]
    path = saved_checkpoint(model, tmp_path)
    before = path.read_bytes()
    rt = stagehand.offload(model, device="cpu", precision="int8", keep_full="file", checkpoint=path)
    kinds = rt.stats()["host"]["bytes_by_kind"]
    assert set(kinds) == {"bf16 file", "int8 pinned"} and rt.stats()["host"]["keep_full"] == "file"
    assert rt.store.host_bytes() == kinds["int8 pinned"]  # no full-precision copy in RAM
    assert torch.equal(model.blocks[2].down.weight, plain.blocks[2].down.weight)  # state_dict reads the file
    with torch.no_grad():
        assert rel_err(model(x), int8_reference(plain, "int8")(x)) < 6e-7  # measured 2.3e-7 (CPU, torch 2.13, 3 seeds)
        # A write reaches the next call (the INT8 copy is rebuilt from the file views) and never the file.
        model.blocks[1].up.weight.mul_(0.5)
        plain.blocks[1].up.weight.mul_(0.5)
        assert rel_err(model(x), int8_reference(plain, "int8")(x)) < 6e-7  # measured 2.2e-7
    assert rt.stats()["requantized_blocks"] == 1
    rt.set_precision({1: "bf16"})  # a flat copy derived from the file master streams, locked
    assert (1, "bf16") in _locked(rt)
    with torch.no_grad():
        # measured 2.1e-7 (CPU, torch 2.13, 3 seeds)
        assert rel_err(model(x), int8_reference(plain, {0: "int8", 1: "bf16", 2: "int8", 3: "int8"})(x)) < 6e-7
    rt.set_precision("int8")  # and goes again: the file holds those weights
    assert not rt.store.has(1, "bf16")
    rt.restore()
    assert torch.equal(model.blocks[1].up.weight, plain.blocks[1].up.weight)
    assert path.read_bytes() == before


def test_keep_full_file_refuses_a_file_that_is_not_the_models(tmp_path):
    model, _ = toy(n=3)
    path = saved_checkpoint(model, tmp_path)
    with torch.no_grad():
        model.blocks[1].down.weight.add_(1.0)
    with pytest.raises(CheckpointError, match=r"blocks\.1\.down\.weight differs"):
        stagehand.offload(model, device="cpu", precision="int8", keep_full="file", checkpoint=path)
    assert not any(type(m).__name__.startswith("Streamed") for m in model.modules())


def test_keep_full_file_without_a_checkpoint_says_what_to_pass():
    model, _ = toy(n=2)
    with pytest.raises(ValueError, match=r"checkpoint="):
        stagehand.offload(model, device="cpu", precision="int8", keep_full="file")


def test_keep_full_is_a_config_field_checked_by_name():
    with pytest.raises(ConfigError, match="keep_full: must be"):
        stagehand.Config(keep_full="disk").validate()


# ---- preflight ----------------------------------------------------------------------------------------


def _machine(monkeypatch, available, **kw):
    fake = MachineMemory(total_bytes=8 * GiB, available_bytes=available, **kw)
    monkeypatch.setattr(host_budget, "probe_machine", lambda: fake)
    return fake


def test_preflight_refuses_before_anything_moves_with_the_numbers_and_the_fix(monkeypatch):
    model, _ = toy(n=4, d=64)
    weights = dict(model.named_parameters())
    _machine(monkeypatch, available=4096)  # a few KB: nothing but the smallest plan fits
    with pytest.raises(HostMemoryError, match=r"does not fit.*more host memory.*MemAvailable.*keep_full='file'"):
        stagehand.offload(model, device="cpu", precision="int8", keep_full="ram")
    assert all(dict(model.named_parameters())[k] is v for k, v in weights.items())  # not a tensor was replaced


def test_preflight_counts_a_cgroup_limit(monkeypatch):
    model, _ = toy(n=4, d=64)
    _machine(monkeypatch, available=8 * GiB, cgroup_limit_bytes=GiB, cgroup_used_bytes=GiB - 1000)
    with pytest.raises(HostMemoryError, match=r"cgroup limit 1\.00 GiB"):
        stagehand.offload(model, device="cpu", precision="int8", config=stagehand.Config(keep_full="pinned"))


def test_preflight_refuses_more_pinned_memory_than_wsl_allows(monkeypatch, pinner):
    model, _ = toy(n=4, d=64)
    _machine(monkeypatch, available=8 * GiB, pinned_cap_bytes=1000, where="wsl")
    with pytest.raises(HostMemoryError, match=r"wsl pins at most"):
        stagehand.offload(model, device="cpu", precision="int8")


def test_auto_keeps_masters_in_the_file_when_ram_is_short(monkeypatch, tmp_path):
    model, x = toy(n=4, d=64)
    path = saved_checkpoint(model, tmp_path)
    plain = copy.deepcopy(model)
    int8 = 4 * (64 * 128 + 4 * 128 + 128 * 64 + 4 * 64)  # the INT8 copies of the 4 blocks, about
    _machine(monkeypatch, available=int8 * 2)
    # The model's weights are in RAM: moving its masters into the store takes no new memory.
    rt = stagehand.offload(model, device="cpu", precision="int8", checkpoint=path)
    assert rt.stats()["host"]["keep_full"] == "ram"
    rt.restore()
    # Built on the meta device, the masters would be new memory (4x the INT8 bytes in fp32): they stay in the file.
    meta = copy.deepcopy(plain).to("meta")
    rt = stagehand.offload(meta, device="cpu", precision="int8", checkpoint=path)
    assert rt.stats()["host"]["keep_full"] == "file"
    with torch.no_grad():
        assert rel_err(meta(x), int8_reference(plain, "int8")(x)) < 9e-7  # measured 3.3e-7 (CPU, torch 2.13, 3 seeds)


# ---- on a CUDA device: real page-locking ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pins_exactly_the_int8_copies_and_unpins_on_restore(tmp_path):
    model, x = toy(d=512, n=6, dtype=torch.bfloat16)
    plain = copy.deepcopy(model)
    rt = stagehand.offload(model, device="cuda", precision="int8", keep_full="ram")
    int8 = [rt.store.buffer(b, "int8") for b in range(6)]
    masters = [rt.store.buffer(b, "bf16") for b in range(6)]
    assert all(page_locked(buf) for buf in int8) and not any(page_locked(buf) for buf in masters)
    host = rt.stats()["host"]
    assert host["pinned_requested_bytes"] == sum(b.numel() for b in int8)
    assert host["pinned_locked_bytes"] <= sum(page_round(b.numel()) for b in int8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand")
    with torch.no_grad():
        got = compiled(x.cuda())
        assert rel_err(got, int8_reference(plain, "int8").cuda()(x.cuda())) < 2e-2
    rt.set_precision({0: "bf16"})  # block 0's master now streams: locked; its INT8 copy is not
    assert page_locked(rt.store.buffer(0, "bf16")) and not page_locked(rt.store.buffer(0, "int8"))
    with torch.no_grad():
        compiled(x.cuda())
    rt.restore()
    assert not any(page_locked(buf) for buf in int8)
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(model.modules(), plain.modules()) if hasattr(a, "weight")
               and isinstance(a, torch.nn.Linear))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_on_the_gpu_comes_down_and_builds_its_copies_and_each_buffer_tells_its_own_lock(tmp_path):
    """A model on the GPU: its masters come down and its int8 copies are built on the GPU, then only the int8
    copies stay locked, and each buffer's own `is_pinned()` says so; the computation is the plain model's."""
    model, x = toy(d=512, n=6, dtype=torch.bfloat16)
    plain = copy.deepcopy(model)
    model.cuda()
    rt = stagehand.offload(model, device="cuda", precision="int8", keep_full="ram")
    int8 = [rt.store.buffer(b, "int8") for b in range(6)]
    masters = [rt.store.buffer(b, "bf16") for b in range(6)]
    assert all(page_locked(buf) and buf.is_pinned() for buf in int8)
    assert not any(page_locked(buf) or buf.is_pinned() for buf in masters)
    for b in range(6):
        assert torch.equal(model.blocks[b].up.weight, plain.blocks[b].up.weight)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="stagehand")(x.cuda())
        assert rel_err(got, int8_reference(plain, "int8").cuda()(x.cuda())) < 2e-2
    rt.restore()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_slab_offload_locks_each_int8_block_beside_the_reads(tmp_path):
    """From a slab on CUDA, the reader threads page-lock each INT8 block as its rows land (cudaHostRegister on a
    thread that is not the one that made the CUDA context): the driver then says every INT8 copy is locked, the
    masters are not, and the compiled forward reads them right."""
    from torch_stagehand.runtime.slab import build_slab_from_module

    model, x = toy(d=512, n=6, dtype=torch.bfloat16)
    plain = copy.deepcopy(model)
    manifest = build_slab_from_module(model, tmp_path, "toy", "toy", include_prefixes=("blocks.",), progress=False,
                                      print_report=False, compare_quantizers=False).manifest_path
    # The reader threads (the default on Linux is a reader process whose rows land after offload returns).
    rt = stagehand.offload(model, device="cuda", precision="int8", keep_full="ram", slab=manifest,
                           config=stagehand.Config(slab_reads="threads"))
    assert "slab reads" in rt.stats()["offload"]["beside"]
    assert all(page_locked(rt.store.buffer(b, "int8")) for b in range(6))
    assert not any(page_locked(rt.store.buffer(b, "bf16")) for b in range(6))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x.cuda())  # the slab's rows through the eager path
        got = torch.compile(model, backend="stagehand")(x.cuda())
    assert rel_err(got, eager) < 1e-2 and rel_err(eager, plain.cuda()(x.cuda())) < 5e-2
    rt.restore()


def test_explain_says_where_the_host_copies_are(pinner):
    model, x = toy(n=2)
    rt = stagehand.offload(model, device="cpu", precision="int8", keep_full="ram")
    torch._dynamo.reset()
    report = stagehand.explain(model, x)
    assert "keep_full='ram'" in str(report) and "int8 pinned" in str(report) and "bf16 ram" in str(report)
    assert report.stats["host"]["pinned_locked_bytes"] == sum(page_round(rt.store.nbytes(b, "int8")) for b in range(2))


def test_a_page_lock_refused_during_a_run_leaves_the_buffer_pageable_and_says_so(monkeypatch, caplog):
    """After offload (a run in progress) a refusal must not end the run: weights set to train after offload get
    their gradient buffers then, and one the driver refuses to lock stays pageable, with a warning that names
    the locked-memory limit and the cost; the numbers do not change."""
    import logging

    fake = RecordingPinner()
    monkeypatch.setattr(host_arena, "pinner_for", lambda device, pin: fake)
    model, x = toy(n=3)
    plain = copy.deepcopy(model).requires_grad_(True)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    fake.fail_at = fake.calls + 2  # the second gradient buffer the run asks to lock
    with caplog.at_level(logging.WARNING, logger="torch_stagehand"):
        model.requires_grad_(True)
    model(x).square().mean().backward()
    assert "could not pin block 1's gradient buffer" in caplog.text and "ulimit -l" in caplog.text
    assert "pageable" in caplog.text
    assert rt.stats()["host"]["pin_refusals"] == 1
    plain(x).square().mean().backward()
    for s in rt.layers:
        ref = dict(plain.named_parameters())[s.fqn + ".weight"].grad
        assert torch.allclose(s.module.weight.grad, ref, rtol=1e-5, atol=1e-6), s.fqn
    rt.close()


def test_a_page_lock_refused_during_offload_is_refused_with_the_limit_and_the_way_out(monkeypatch):
    monkeypatch.setattr(host_arena, "pinner_for", lambda device, pin: RecordingPinner(fail_at=2))
    model, _ = toy(n=3)
    with pytest.raises(torch.OutOfMemoryError, match=r"ulimit -l.*Config\(pin_memory=False\)"):
        stagehand.offload(model, device="cpu", verbose=False)


def test_restore_unlocks_the_optimizers_pinned_states_too(monkeypatch):
    """HostAdamW pins the states of the blocks it updates on the device; restore() unlocks every range."""
    from torch_stagehand.optim import HostAdamW

    fake = RecordingPinner()
    monkeypatch.setattr(host_arena, "pinner_for", lambda device, pin: fake)
    model, x = toy(n=3)
    model.requires_grad_(True)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    opt = HostAdamW(model.parameters(), lr=1e-3, device_update=[0, 2])
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    store_locked = sum(a.locked_bytes for a in rt.store.arenas)
    assert sum(fake.locked.values()) > store_locked  # the optimizer's states are locked beside the store
    rt.restore()
    assert fake.locked == {}


def test_a_long_run_with_precision_switches_holds_its_host_memory_flat_and_restore_frees_all(pinner):
    """A soak in miniature: 120 full fine-tuning steps (HostAdamW, two blocks updated on the "device"), the
    precision map switched every 10 steps; after the first round of switches no host allocation is added and
    the locked bytes stay where they were; restore() then unlocks every range (the optimizer's too) and every
    host buffer dies with it."""
    from torch_stagehand.optim import HostAdamW

    model, x = toy(n=4)
    model.requires_grad_(True)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    opt = HostAdamW(model.parameters(), lr=1e-3, device_update=[1, 3])
    maps = [{0: "bf16", 1: "int8", 2: "bf16", 3: "int8"}, {0: "int8", 1: "bf16", 2: "int8", 3: "bf16"}]
    rounds = []
    for step in range(120):
        if step % 10 == 0:
            rt.set_precision(maps[(step // 10) % 2])
            rounds.append((len(rt.store.arenas), sum(pinner.locked.values())))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)
    assert len(set(rounds[2:])) == 1, f"host allocations / locked bytes moved after the first switches: {rounds}"
    buffers = [weakref.ref(buf) for bb in rt.store.blocks for buf in bb.buffers.values()]
    rt.restore()
    gc.collect()
    assert pinner.locked == {}
    assert all(r() is None for r in buffers), "a host buffer outlived restore()"
