"""Launches worked out once and replayed (kernels/launch_memo.py).

CPU: the recording and replay logic against a stand-in for a Triton kernel (the
interpreter never records: it has no compiled binary), and the key's
sensitivity. GPU: replayed W8A16 calls (fused, split, dequantize + cuBLAS)
give the numbers of the full path, on new tensors, and a key change (alignment,
strides, bias) takes the full path again.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from torch_stagehand.kernels import int8_linear_grad_input_ref, int8_linear_ref, quantize_per_row
from torch_stagehand.kernels.launch_memo import Executor, LaunchMemo, bind, tensor_key


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default

    @property
    def has_default(self):
        return self.default is not inspect.Parameter.empty


class _Compiled:
    """What Triton's jit returns: a binary whose launcher takes (grid, stream, function, meta, hooks, *args)."""

    def __init__(self, log):
        self.function, self.packed_metadata, self.log = "fn", "meta", log

    def run(self, g0, g1, g2, stream, function, meta, launch_metadata, enter, exit_, *args):
        self.log.append(((g0, g1, g2), stream, args))


class _FakeKernel:
    """A stand-in JITFunction: `kernel[grid](*args, **kwargs)` adds x into y and returns its binary."""

    def __init__(self):
        self.arg_names = ["x_ptr", "y_ptr", "n", "BLOCK", "FLAG"]
        self.params = [_Param(n) for n in self.arg_names[:-1]] + [_Param("FLAG", False)]
        self.slow_calls, self.replayed = 0, []
        self.compiled = _Compiled(self.replayed)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.slow_calls += 1
            x, y = args[0], args[1]
            y.copy_(x + 1)
            return self.compiled

        return launch


def test_bind_orders_arguments_by_signature_and_fills_defaults():
    k = _FakeKernel()
    x = torch.zeros(2)
    assert bind(k, (x, x, 4), dict(BLOCK=8, num_warps=4)) == [x, x, 4, 8, False]
    with pytest.raises(TypeError, match="BLOCK"):
        bind(k, (x, x, 4), {})


def test_replay_runs_the_recorded_binary_with_the_new_tensors():
    k = _FakeKernel()
    memo = LaunchMemo("fake")
    x = torch.arange(4.0)
    ex = Executor(dict(x=x), record=True)
    y = ex.buffer("y", (4,), torch.float32, "cpu")
    ex.kernel(k, (3,), x, y, 4, BLOCK=8, num_warps=4)
    assert torch.equal(y, x + 1) and k.slow_calls == 1
    memo.add("key", ex, torch.device("cpu"))
    assert memo.stats() == {"keys": 1, "hits": 0, "misses": 1}

    x2 = torch.full((4,), 7.0)
    out = memo.get("key")(dict(x=x2))
    assert k.slow_calls == 1, "a replay must not go through the kernel's jit path"
    (grid, stream, args), = k.replayed
    assert grid == (3, 1, 1) and stream == 0
    assert args[0] is x2 and args[1] is out["y"] and args[1] is not y  # new input, a fresh output buffer
    assert args[2:] == (4, 8, False)
    assert memo.stats()["hits"] == 1


def test_a_tensor_the_replay_cannot_supply_makes_the_call_unrecordable():
    k = _FakeKernel()
    x, stray = torch.zeros(4), torch.zeros(4)
    ex = Executor(dict(x=x), record=True)
    ex.kernel(k, (1,), x, stray, 4, BLOCK=8)  # `stray` is neither a role, a buffer nor a constant
    memo = LaunchMemo("fake")
    memo.add("key", ex, torch.device("cpu"))
    assert memo.get("key") is None and memo.stats()["misses"] == 1

    ex = Executor(dict(x=x), record=True, constants=(stray,))  # a persistent constant is fine
    ex.kernel(k, (1,), x, stray, 4, BLOCK=8)
    memo.add("key", ex, torch.device("cpu"))
    assert memo.get("key") is not None


def test_torch_steps_replay_on_the_new_tensors():
    ex = Executor(dict(a=torch.ones(3)), record=True)
    ex.buffer("out", (3,), torch.float32, "cpu")
    ex.torch(lambda t: torch.mul(t["a"], 2, out=t["out"]))
    replay = ex.replay(torch.device("cpu"))
    out = replay(dict(a=torch.full((3,), 5.0)))["out"]
    assert torch.equal(out, torch.full((3,), 10.0))


def test_an_interpreted_launch_is_never_recorded():
    class Interpreted(_FakeKernel):
        def __getitem__(self, grid):
            inner = super().__getitem__(grid)
            return lambda *a, **kw: (inner(*a, **kw), None)[1]  # the interpreter returns no binary

    x = torch.zeros(2)
    ex = Executor(dict(x=x), record=True)
    y = ex.buffer("y", (2,), torch.float32, "cpu")
    ex.kernel(Interpreted(), (1,), x, y, 2, BLOCK=2)
    assert ex.replay(torch.device("cpu")) is None


def test_a_compile_only_executor_compiles_each_kernel_and_launches_nothing():
    class Warmable(_FakeKernel):
        def __init__(self):
            super().__init__()
            self.warmed = []

        def warmup(self, *args, grid, **kwargs):
            self.warmed.append((grid, args[2:], kwargs))
            return self.compiled

    k, x = Warmable(), torch.zeros(4)
    ex = Executor(dict(x=x), record=True, compile_only=True)
    y = ex.buffer("y", (4,), torch.float32, "cpu").zero_()
    ex.kernel(k, (3,), x, y, 4, BLOCK=8, num_warps=4)
    ex.torch(lambda t: t["y"].fill_(5.0))
    assert k.warmed == [((3,), (4,), dict(BLOCK=8, num_warps=4))] and k.slow_calls == 0
    assert torch.equal(y, torch.zeros(4))  # neither the kernel nor the torch step ran
    assert ex.replay(torch.device("cpu")) is None  # and nothing is recorded for a replay


def test_precompile_all_compiles_every_candidate_on_threads_and_leaves_failures_to_the_timed_loop(monkeypatch):
    import threading

    from torch_stagehand.kernels.tuning import autotune as tune

    configs = [tune.LaunchConfig(64, 16, 128, s) for s in (1, 2, 4, 8)]
    seen, threads = [], set()

    def precompile(cfg):
        threads.add(threading.get_ident())
        seen.append(cfg)
        if cfg.split == 4:
            raise RuntimeError("out of shared memory")  # swallowed: the timed loop rejects it with its reason

    monkeypatch.setenv("STAGEHAND_TUNE_THREADS", "4")
    tune.precompile_all(configs, precompile, torch.device("cpu"))
    assert sorted(seen, key=lambda c: c.split) == configs and threading.get_ident() not in threads
    seen.clear()
    monkeypatch.setenv("STAGEHAND_TUNE_THREADS", "1")  # one thread: each compiles as it is first run
    tune.precompile_all(configs, precompile, torch.device("cpu"))
    assert seen == []


def test_the_key_sees_shape_strides_dtype_and_alignment():
    base = torch.zeros(64, dtype=torch.bfloat16)
    a, b = base[:32].view(4, 8), base[8:40].view(4, 8)  # 16 bytes in: aligned
    c = base[1:33].view(4, 8)  # 2 bytes in: not 16-byte aligned
    assert tensor_key(a) == tensor_key(b)
    assert tensor_key(a) != tensor_key(c)
    assert tensor_key(a) != tensor_key(base[:32].view(8, 4))
    assert tensor_key(a) != tensor_key(base[:32].view(8, 4).t())
    assert tensor_key(a) != tensor_key(torch.zeros(4, 8))
    assert tensor_key(None) is None


# ----------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _weights(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_per_row(torch.randn(n, k, generator=g) * 0.05)
    return q.cuda(), s.cuda()


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [16, 256, 2048])  # fused, split (small M) and dequantize + cuBLAS (large M)
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_replayed_calls_equal_the_full_path(m, bias):
    from torch_stagehand.kernels.launch import (BWD_MEMO, FWD_MEMO, clear_launch_memo,
                                                int8_linear_grad_input_triton, int8_linear_triton)

    clear_launch_memo()
    n, k = 1536, 1024
    q, s = _weights(n, k, m)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    xs = [torch.randn(2, m // 2, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    dys = [torch.randn(2, m // 2, n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ys = [int8_linear_triton(x, q, s, b) for x in xs]
    dxs = [int8_linear_grad_input_triton(dy, q, s) for dy in dys]
    assert FWD_MEMO.stats()["hits"] == 2 and BWD_MEMO.stats()["hits"] == 2, (FWD_MEMO.stats(), BWD_MEMO.stats())
    for x, y, dy, dx in zip(xs, ys, dys, dxs):
        assert _rel(y, int8_linear_ref(x, q, s, b)) < 1e-2
        assert _rel(dx, int8_linear_grad_input_ref(dy, q, s)) < 1e-2
    # The full path with the same (now tuned) config gives the same bits as the replay.
    from torch_stagehand.kernels import tuned_configs
    from torch_stagehand.kernels.tuning.autotune import bucket

    chosen = tuned_configs()[("fwd", xs[-1].device, bucket(m), n, k, torch.bfloat16)]
    assert torch.equal(ys[-1], int8_linear_triton(xs[-1], q, s, b, config=chosen))


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [16, 2048])
def test_gpu_candidates_compiled_on_threads_are_tried_and_checked_as_compiled_one_by_one(m, monkeypatch, tmp_path):
    """A key tuned with its candidates compiled at once on threads (first, in a fresh Triton cache: they really
    compile there) times and rejects the same candidates as one tuned serially, and its output is right."""
    from torch_stagehand.kernels.tuning import autotune as tune
    from torch_stagehand.kernels.launch import clear_launch_memo, int8_linear_triton

    n, k = 1536, 1024
    q, s = _weights(n, k, m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("STAGEHAND_TUNE_CACHE", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    logs = {}
    for threads in ("8", "1"):
        monkeypatch.setenv("STAGEHAND_TUNE_THREADS", threads)
        clear_launch_memo()
        tune._LOG.clear()
        y = int8_linear_triton(x, q, s)
        assert _rel(y, int8_linear_ref(x, q, s)) < 1e-2
        (logs[threads],) = tune.tuning_log().values()
    assert set(logs["8"]["times_us"]) == set(logs["1"]["times_us"])
    assert set(logs["8"]["rejected"]) == set(logs["1"]["rejected"])


@gpu
@needs_cuda
def test_gpu_a_changed_key_takes_the_full_path():
    from torch_stagehand.kernels.launch import FWD_MEMO, clear_launch_memo, int8_linear_triton

    clear_launch_memo()
    q, s = _weights(512, 256, 3)
    big = torch.randn(64 * 256 + 8, device="cuda", dtype=torch.bfloat16)
    aligned, shifted = big[:64 * 256].view(64, 256), big[1:64 * 256 + 1].view(64, 256)
    int8_linear_triton(aligned, q, s)
    y = int8_linear_triton(shifted, q, s)  # 2 bytes off 16-byte alignment: another specialization
    assert FWD_MEMO.stats() == {"keys": 2, "hits": 0, "misses": 2}
    assert _rel(y, int8_linear_ref(shifted, q, s)) < 1e-2
    y_t = int8_linear_triton(aligned.t().contiguous().t()[:, :256], q, s)  # other strides
    assert FWD_MEMO.stats()["misses"] == 3
    assert _rel(y_t, int8_linear_ref(aligned, q, s)) < 1e-2


def test_the_memo_steps_aside_while_a_launch_hook_is_installed():
    pytest.importorskip("triton")
    from triton import knobs

    memo = LaunchMemo("fake")
    assert memo.enabled(interpreting=False), "no hook installed: replays allowed"
    assert not memo.enabled(interpreting=True)
    hook = knobs.runtime.launch_enter_hook

    def profiler(metadata):
        return None

    if hasattr(hook, "add"):  # Triton 3.6+: a HookChain
        hook.add(profiler)
        try:
            assert not memo.enabled(interpreting=False)
        finally:
            hook.remove(profiler)
    else:
        knobs.runtime.launch_enter_hook = profiler
        try:
            assert not memo.enabled(interpreting=False)
        finally:
            knobs.runtime.launch_enter_hook = hook
    assert memo.enabled(interpreting=False)
