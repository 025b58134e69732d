"""Offload copies the weights into the host store on a worker thread while its calling thread prepares the
compiler (imports, compile workers, Dynamo's source index): the two run at once, the store gets every weight
exactly, the stage clock says how long each side took, and an error on either side leaves the model as it was."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand import api
from torch_stagehand.runtime.host import setup as host_setup
from torch_stagehand.runtime.beside import run_beside
from torch_stagehand.runtime.telemetry.stage_clock import COMPILER_PREPARATION

from _helpers import assert_exact, saved_checkpoint, toy
from test_offload_transaction import _assert_untouched, _snapshot


def test_the_work_and_the_calling_threads_part_run_at_once():
    """Each side waits for a sign from the other: only two threads running together finish."""
    work_started, calling_started, seen = threading.Event(), threading.Event(), {}

    def work():
        work_started.set()
        assert calling_started.wait(timeout=30)
        seen["work"] = threading.current_thread().name
        return 42

    def on_calling_thread():
        calling_started.set()
        assert work_started.wait(timeout=30)
        seen["calling"] = threading.current_thread() is threading.main_thread()

    seconds = {}
    assert run_beside(work, on_calling_thread, "stagehand-test", seconds) == 42
    assert seen == {"work": "stagehand-test", "calling": True}
    assert set(seconds) == {"work", "calling thread"} and all(s >= 0 for s in seconds.values())


def test_with_nothing_for_the_calling_thread_the_work_runs_there():
    seconds = {}
    assert run_beside(lambda: threading.current_thread() is threading.main_thread(), None, "stagehand-test",
                      seconds) is True
    assert set(seconds) == {"work"}
    assert not any(t.name == "stagehand-test" for t in threading.enumerate())


def test_an_error_of_the_work_is_raised_once_the_calling_thread_is_done():
    done = []
    with pytest.raises(ValueError, match="block 3 could not be copied"):
        run_beside(lambda: (_ for _ in ()).throw(ValueError("block 3 could not be copied")),
                   lambda: done.append(True), "stagehand-test")
    assert done == [True]


def test_an_error_on_the_calling_thread_waits_for_the_work_and_keeps_its_error_as_the_cause():
    release, finished = threading.Event(), []

    def work():
        release.wait(timeout=30)
        finished.append(True)
        raise OSError("the copy failed too")

    def on_calling_thread():
        threading.Timer(0.05, release.set).start()  # the work is still running when this raises
        raise ImportError("no module named torch._inductor.something")

    with pytest.raises(ImportError, match="torch._inductor.something") as raised:
        run_beside(work, on_calling_thread, "stagehand-test")
    assert finished == [True]  # joined before the error reached the caller: nothing writes behind it
    assert isinstance(raised.value.__cause__, OSError)


class _Preparation:
    """The CUDA path's compiler preparation, doing `work` instead (no parts timed)."""

    def __init__(self, work):
        self.work, self.seconds = work, {}

    def __call__(self):
        self.work()


def _prepare_on_cpu(monkeypatch, prepare):
    """offload on the CPU prepares no compiler: give it `prepare` as the CUDA path would."""
    monkeypatch.setattr(api, "compiler_preparation", lambda model, device: _Preparation(prepare))


def test_offload_copies_on_a_worker_while_the_calling_thread_prepares(monkeypatch):
    model, x = toy(n=6)
    expected = copy.deepcopy(model)(x)
    copying, seen = [], []
    original = host_setup._copy_masters

    def copy_masters(store, checkpoint, progress):
        copying.append(threading.current_thread().name)
        return original(store, checkpoint, progress)

    def prepare():
        seen.append(threading.current_thread() is threading.main_thread())

    monkeypatch.setattr(host_setup, "_copy_masters", copy_masters)
    _prepare_on_cpu(monkeypatch, prepare)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    try:
        assert copying == ["stagehand-masters"] and seen == [True]
        beside = rt.offload_summary["beside"]
        assert {"masters copied", COMPILER_PREPARATION} <= set(beside)
        with torch.no_grad():
            assert_exact(model(x), expected)  # every weight landed where its layer reads it
    finally:
        rt.restore()


@pytest.mark.parametrize("side", ["copy", "preparation"])
def test_an_error_on_either_side_leaves_the_model_as_it_was(monkeypatch, side):
    model, x = toy(n=4)
    before = _snapshot(model)

    def copy_masters(store, checkpoint, progress):
        if side == "copy":
            raise MemoryError("no room for block 1's master copy")
        return original(store, checkpoint, progress)

    def prepare():
        if side == "preparation":
            raise RuntimeError("Inductor's compile workers did not start")

    original = host_setup._copy_masters
    monkeypatch.setattr(host_setup, "_copy_masters", copy_masters)
    _prepare_on_cpu(monkeypatch, prepare)
    with pytest.raises((MemoryError, RuntimeError), match="block 1's master|did not start"):
        stagehand.offload(model, device="cpu", verbose=False)
    _assert_untouched(model, before)


def test_weights_left_in_their_file_are_not_copied_and_the_preparation_still_runs(monkeypatch, tmp_path):
    """keep_full="file": the masters are views of the mapped checkpoint, so no worker copies anything; the
    preparation runs on the calling thread all the same, and the model computes as before."""
    model, x = toy(n=4)
    expected = copy.deepcopy(model)(x)
    path = saved_checkpoint(model, tmp_path)
    copied, seen = [], []
    monkeypatch.setattr(host_setup, "_copy_masters", lambda *a: copied.append(True))
    _prepare_on_cpu(monkeypatch, lambda: seen.append(threading.current_thread() is threading.main_thread()))
    rt = stagehand.offload(model, device="cpu", keep_full="file", checkpoint=path, verbose=False)
    try:
        assert copied == [] and seen == [True]
        with torch.no_grad():
            assert_exact(model(x), expected)
    finally:
        rt.restore()
