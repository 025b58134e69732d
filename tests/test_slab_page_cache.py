"""Offload from a slab asks the kernel for the slab's pages ahead of its reads (one posix_fadvise on a thread of its
own, where the machine has room for them), and reads the blocks in the file's order, the order those pages come in."""

from __future__ import annotations

import os
import threading

import pytest

import torch_stagehand as stagehand
from torch_stagehand.runtime import host_budget
from torch_stagehand.runtime.slab import build_slab_from_module, loading, page_cache
from torch_stagehand.runtime.slab.reader import SlabReader

from _helpers import toy

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")


def _machine(available: int) -> host_budget.MachineMemory:
    return host_budget.MachineMemory(total_bytes=available, available_bytes=available)


def test_the_range_is_asked_of_the_kernel_on_a_thread_of_its_own(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(10000))
    asked = []

    def fadvise(fd, offset, length, advice):
        asked.append((offset, length, advice, threading.current_thread().name))

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(host_budget, "probe_machine", lambda: _machine(1 << 30))
    ahead, why = page_cache.ask_kernel_ahead(str(path), 100, 9000)
    ahead.thread.join(timeout=60)
    assert asked == [(100, 8900, os.POSIX_FADV_WILLNEED, "stagehand-slab-pages")]
    assert ahead.seconds is not None and ahead.error is None and "asked of the kernel" in why


def test_nothing_is_asked_without_room_for_the_pages_beside_the_store(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: pytest.fail("asked without room"))
    monkeypatch.setattr(host_budget, "probe_machine", lambda: _machine(15000))
    ahead, why = page_cache.ask_kernel_ahead(str(tmp_path / "f.bin"), 0, 10000)  # 20000 bytes needed
    assert ahead is None and "needed" in why


def test_a_failed_request_leaves_the_reads_to_the_readers(tmp_path):
    ahead, _ = page_cache.ask_kernel_ahead(str(tmp_path / "gone.bin"), 0, 10)
    ahead.thread.join(timeout=60)
    assert isinstance(ahead.error, OSError) and ahead.seconds is not None


def test_offload_asks_for_the_slabs_data_and_reads_its_blocks_in_the_files_order(tmp_path, monkeypatch):
    model, x = toy(n=12, d=16)  # blocks.10 and blocks.11 lie before blocks.2 in the file (names sorted)
    result = build_slab_from_module(model, tmp_path, "toy", "toy", include_prefixes=("blocks.",), progress=False,
                                    print_report=False, compare_quantizers=False)
    with SlabReader(result.manifest_path) as reader:
        tensors = reader.header.tensors.values()
        data = (min(t.start for t in tensors), max(t.end for t in tensors))
        first = {int(name.split(".")[1]): reader.header.tensors[e.qweight_key].start
                 for name, e in reader.layers.items()}
    asked, order = [], []
    ask = loading.ask_kernel_ahead
    monkeypatch.setattr(loading, "ask_kernel_ahead", lambda path, b, e: asked.append((path, b, e)) or ask(path, b, e))
    read_in_parallel = loading._read_in_parallel

    def record(reader, blocks, *args, **kwargs):
        def groups():
            for group in blocks:
                order.append(group[0][4].block)
                yield group
        return read_in_parallel(reader, groups(), *args, **kwargs)

    monkeypatch.setattr(loading, "_read_in_parallel", record)
    rt = stagehand.offload(model, device="cpu", precision="int8", slab=result.manifest_path, verbose=False)
    try:
        assert asked == [(result.safetensors_path, *data)]
        assert sorted(order) == list(range(12)) and order == sorted(order, key=first.get)
        assert order != sorted(order)  # the file's order is not the model's here
    finally:
        rt.restore()
