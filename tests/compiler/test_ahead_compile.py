"""Variants compiled ahead of need in worker processes (compiler/startup/ahead.py): a recomputed block's first forward hands
its training variant to a worker and runs the variant graph eagerly; the backward loads what the worker compiled
(AOTAutograd's cache hits); a job that fails, or one still queued when its variant is needed, costs the main
process its own compile and nothing else."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

import torch_stagehand as stagehand
from torch_stagehand.compiler.startup import compile_cache
from torch_stagehand.compiler.startup.ahead import AheadCompiler, AheadJob
from torch_stagehand.compiler.startup.ahead_wire import input_specs, pickle_graph
from torch_stagehand.compiler.startup.ahead_worker import fake_inputs
from torch_stagehand.compiler.context import BackendOptions, BackendOptionsError
from torch_stagehand.config import ConfigError
from torch_stagehand.compiler.inner import compile_unit
from torch_stagehand.compiler.passes import JOINT_PASSES
from torch_stagehand.compiler.variants import variant_cache

from _helpers import rel_err
from test_regional_compile import _lora_grads, _lora_qwen2


@pytest.fixture
def fresh_caches(tmp_path, monkeypatch):
    """Inductor's and Triton's caches empty and this test's own (the workers inherit the environment)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("STAGEHAND_CACHE_DIR", str(tmp_path / "stagehand"))  # the compile bundles ...
    monkeypatch.setenv("STAGEHAND_COMPILE_CACHE", "1")  # ... written (conftest turns them off)
    torch._dynamo.reset()
    yield tmp_path
    torch._dynamo.reset()


def _train_step(workers: int):
    """One LoRA step of a 3-block Qwen2 through Inductor, every block recomputed: an inference variant (the forward)
    and a training variant (the recompute), compiled by the step itself, or with workers by them while the
    forward runs eagerly."""
    model, ids = _lora_qwen2(3)
    plain = copy.deepcopy(model)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    stagehand.compile_blocks(model, options={"inner": "inductor", "recompute": "blocks", "ahead_workers": workers})
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    cache = variant_cache(rt)
    infos = list(cache.info.values())
    stats = dict(cache.ahead.stats) if cache.ahead is not None else None
    grads = _lora_grads(model)
    rt.restore()
    return loss.detach(), grads, infos, stats, plain


def test_the_forward_runs_eagerly_while_a_worker_compiles_and_the_backward_loads_it(fresh_caches, monkeypatch):
    import contextlib

    from torch_stagehand import kernels

    deferrals = []

    @contextlib.contextmanager
    def deferred_tuning():
        deferrals.append(True)
        yield

    monkeypatch.setattr(kernels, "deferred_tuning", deferred_tuning)
    loss, grads, infos, stats, _ = _train_step(workers=2)
    # The first block's forward handed its training variant and its inference variant to the workers and ran
    # the variant graph eagerly, as did the two blocks after it; the backward's recompute loaded the training
    # variant the worker compiled (torch's caches). The inference variant waits for the next step's forward.
    assert stats["submitted"] == 2 and len(stats["worker_pids"]) == 2
    # Each of the three blocks' forwards ran its graph eagerly with the W8A16 tuning deferred (kernels/tuning/autotune.py).
    assert deferrals == [True] * 3
    assert [i["cache"] for i in infos] == ["hit"] and not stats["refused"]
    assert infos[0]["ahead"].startswith("compiled ahead in a worker") and "(miss)" in infos[0]["ahead"]
    # Loaded, but compiled in this run (by its worker): the model's bundle is written, so the next run knows the
    # model is compiled and starts no workers (a run that wrote none was 22 s into its first step on an H100).
    assert list((fresh_caches / "stagehand" / "compile").glob("*.bundle"))

    torch._dynamo.reset()  # the same step compiled in process alone, in other caches
    import os

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh_caches / "inductor-serial")
    os.environ["STAGEHAND_CACHE_DIR"] = str(fresh_caches / "stagehand-serial")
    serial_loss, serial_grads, serial_infos, serial_stats, _ = _train_step(workers=0)
    assert serial_stats is None and [i["cache"] for i in serial_infos] == ["miss", "miss"]
    assert len(deferrals) == 3  # without workers every forward ran the compiled variant: nothing deferred
    # The eager forward against the compiled one (the backward is the same compiled variant): measured loss
    # 0, grads 8e-7 (CPU, torch 2.13).
    assert rel_err(loss, serial_loss) < 1e-5
    assert grads.keys() == serial_grads.keys()
    assert max(rel_err(grads[n], serial_grads[n]) for n in grads) < 1e-4

    # A machine that kept only the workers run's compile bundle (torch's caches empty): the bundle holds the
    # training variant its worker compiled (torch records a cache hit's artifacts too), which loads; the inference
    # variant, which that run's step never loaded, compiles.
    torch._dynamo.reset()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh_caches / "inductor-bundle-only")
    os.environ["STAGEHAND_CACHE_DIR"] = str(fresh_caches / "stagehand")
    _, _, bundle_infos, _, _ = _train_step(workers=0)
    assert [i["cache"] for i in bundle_infos] == ["miss", "hit"]

    # A next run without workers, in the caches the run with workers filled, loads the unit: a process with
    # workers keys its units as one without (units._code_settled), and computes the serial run's numbers.
    torch._dynamo.reset()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh_caches / "inductor")
    os.environ["STAGEHAND_CACHE_DIR"] = str(fresh_caches / "stagehand")
    warm_loss, warm_grads, warm_infos, _, _ = _train_step(workers=0)
    assert [i["cache"] for i in warm_infos] == ["hit", "hit"]  # both variants: the workers compiled them
    assert torch.equal(warm_loss, serial_loss)
    for name in grads:
        assert torch.equal(warm_grads[name], serial_grads[name]), name


def _tiny_graph() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    def f(x, w):
        return (torch.sin(x) @ w,)

    gm = fx.symbolic_trace(f)
    x = torch.randn(4, 8, requires_grad=True)
    return gm, [x, torch.randn(8, 3)]


def _job(gm, args, key="k", code=None) -> AheadJob:
    return AheadJob(key, f"tiny graph {key}", pickle_graph(gm), gm.code if code is None else code,
                    input_specs(args), True, False, JOINT_PASSES)


def test_a_worker_fills_the_cache_the_main_process_loads_and_a_failed_job_says_why(fresh_caches):
    gm, args = _tiny_graph()
    pool = AheadCompiler(1)
    try:
        assert pool.submit(_job(gm, args))
        assert not pool.submit(_job(gm, args))  # asked for before
        assert pool.submit(_job(gm, args, key="bad", code="def forward(self): pass"))
        result = pool.take("k")
        assert result.error == "" and result.state == "miss", result
        with compile_cache.track() as outcome:
            compiled = compile_unit(gm, list(args), "inductor", lambda *_: None, JOINT_PASSES)
        assert outcome.state == "hit"
        torch.testing.assert_close(compiled(*args)[0], gm(*args)[0])  # (Inductor's sin rounds as it rounds)
        failed = pool.take("bad")
        assert "unpickled to other code" in failed.error and "failed" in failed.describe()
        assert pool.take("never submitted") is None
    finally:
        pool.close()


def test_an_inference_job_waits_until_the_step_first_waits_for_a_training_one(fresh_caches):
    """A job submitted `later` (an inference variant: the next step's forward needs it) is held back, so a free
    worker takes the training variant the forward hands over next; the first `take` (the backward) queues it."""
    gm, args = _tiny_graph()
    pool = AheadCompiler(1)
    try:
        assert pool.submit(_job(gm, args, key="inference"), later=True)
        assert pool.jobs.empty() and len(pool.held) == 1 and not pool.futures["inference"].running()
        assert pool.submit(_job(gm, args, key="training"))
        assert pool.futures["training"].result(timeout=300).error == ""  # the worker took the training job
        assert len(pool.held) == 1 and not pool.futures["inference"].done()  # still held
        assert pool.take("training").error == ""
        assert not pool.held
        assert pool.futures["inference"].result(timeout=300).error == ""  # compiled once the step waited
    finally:
        pool.close()


def test_a_worker_compiles_under_the_attention_backends_the_main_process_allows(fresh_caches):
    """Which attention backend a variant traces to is in no cache key: a worker with torch's defaults compiled
    Flux's attention with cuDNN's, which offload() turns off, under the main process's key (its backward faulted).
    A job carries the main process's settings and the worker compiles under them."""
    from torch_stagehand.compiler.startup import process_settings

    gm, args = _tiny_graph()
    before = process_settings.current()
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.set_float32_matmul_precision("high")
    main = process_settings.current()
    assert main != before
    pool = AheadCompiler(1)
    try:
        pool.submit(_job(gm, args))
        result = pool.take("k")
        assert result.error == "", result.error
        assert result.settings == main and not result.settings["sdpa"]["cudnn"]
    finally:
        pool.close()
        process_settings.adopt(before)
    assert process_settings.current() == before


def test_a_worker_started_before_the_autotune_choice_compiles_under_the_main_processs(fresh_caches, monkeypatch):
    """STAGEHAND_INDUCTOR_AUTOTUNE set after the workers started (offload starts them) travels with the job: the
    worker compiles with the main process's choice (else its cache keys would differ, and the step would compile
    the variant itself), and loading what it wrote hits."""
    monkeypatch.delenv("STAGEHAND_INDUCTOR_AUTOTUNE", raising=False)
    gm, args = _tiny_graph()
    pool = AheadCompiler(1).start()  # its environment: no choice (the default)
    try:
        monkeypatch.setenv("STAGEHAND_INDUCTOR_AUTOTUNE", "0")
        assert pool.submit(_job(gm, args))
        result = pool.futures["k"].result(timeout=300)  # the job, done by the worker (`take` could drop it queued)
        assert result.error == "", result.error
        assert result.settings["inductor_autotune"] == "0"
        with compile_cache.track() as outcome:
            compile_unit(copy.deepcopy(gm), list(args), "inductor", lambda *_: None, JOINT_PASSES)
        assert outcome.state == "hit"
    finally:
        pool.close()


def test_a_job_still_queued_when_its_variant_is_needed_is_dropped(fresh_caches):
    gm, args = _tiny_graph()
    pool = AheadCompiler(1)
    try:
        pool.submit(_job(gm, args, key="first"))
        pool.submit(_job(gm, args, key="second"))  # behind the first, on the one worker
        assert pool.take("second") is None and pool.stats["dropped"] == 1
        assert pool.take("first").error == ""
    finally:
        pool.close()
    assert pool.workers == set() and not pool.submit(_job(gm, args, key="after close"))


def test_input_specs_fake_the_same_sizes_strides_offsets_aliasing_and_grad_flags():
    base = torch.randn(6, 8)
    view = base[2:, 1:5]  # an offset, non-contiguous view of another input's storage
    leaf = torch.randn(3, 4, requires_grad=True)
    scalar = torch.tensor(0.5)  # a float Dynamo passed as a 0-dim tensor: travels by value
    values, faked = fake_inputs(input_specs([base, view, leaf, scalar, 7]))
    fb, fv, fl, fs, n = faked.values
    for fake, real in ((fb, base), (fv, view), (fl, leaf)):
        assert (fake.shape, fake.stride(), fake.storage_offset(), fake.dtype, fake.requires_grad) == \
               (real.shape, real.stride(), real.storage_offset(), real.dtype, real.requires_grad)
    assert fv.untyped_storage()._cdata == fb.untyped_storage()._cdata  # one storage, as in the main process
    assert fl.untyped_storage()._cdata != fb.untyped_storage()._cdata
    assert values[3].item() == 0.5 and n == 7


def test_the_main_process_works_while_it_waits_for_a_running_job_and_not_for_a_finished_one():
    # take()'s while_waiting: what the step does first while a worker is on the job it asks for (the deferred
    # W8A16 tuning); it asks done() between its pieces. A job done already is taken without it.
    from concurrent.futures import Future

    from torch_stagehand.compiler.startup.ahead import AheadResult

    pool = AheadCompiler(1)  # no job submitted: no worker started
    running, finished = Future(), Future()
    for key, future in (("running", running), ("finished", finished)):
        pool.futures[key] = future
        pool.labels[key] = key
        future.set_running_or_notify_cancel()
    finished.set_result(AheadResult(seconds=1.0, state="miss"))
    seen = []

    def work(done):
        seen.append(done())
        running.set_result(AheadResult(seconds=2.0, state="miss"))  # the worker finishes meanwhile
        seen.append(done())

    assert pool.take("finished", while_waiting=work).seconds == 1.0 and seen == []
    assert pool.take("running", while_waiting=work).seconds == 2.0 and seen == [False, True]
    assert pool.busy_waiting_s > 0 and pool.waited_s >= pool.busy_waiting_s
    pool.close()


def test_while_it_waits_the_main_process_loads_the_jobs_other_workers_finished():
    # take(): after while_waiting, each job done without error that the step has not asked for yet is loaded
    # (its `preload`, given at submit), one at a time until the job asked for is done. A failed job is left to the
    # step (it compiles it there), as is a preload that raises; the job asked for is never preloaded.
    from concurrent.futures import Future

    from torch_stagehand.compiler.startup.ahead import AheadResult

    pool = AheadCompiler(1)
    futures = {key: Future() for key in ("asked", "failed", "a", "broken", "b", "c")}
    loaded = []

    def preload(key):
        def load():
            loaded.append(key)
            if key == "broken":
                raise RuntimeError("no such cache entry")
            if key == "b":  # the worker on the job asked for finishes meanwhile
                futures["asked"].set_result(AheadResult(seconds=3.0, state="miss"))
        return load

    for key, future in futures.items():
        pool.futures[key] = future
        pool.labels[key] = key
        pool.preloads[key] = preload(key)
        future.set_running_or_notify_cancel()
        if key != "asked":
            future.set_result(AheadResult(seconds=1.0, state="miss", error="boom" if key == "failed" else ""))
    assert pool.take("asked").seconds == 3.0
    assert loaded == ["a", "broken", "b"]  # "c" waits: the job asked for was done by then
    assert pool.stats["preloaded"] == ["a", "b"] and pool.busy_waiting_s > 0
    assert set(pool.preloads) == {"failed", "c"}  # the asked job's own preload is dropped: its caller loads it
    assert pool.take("c").seconds == 1.0 and loaded == ["a", "broken", "b"]  # done already: nothing preloaded
    queued = pool.futures["queued"] = Future()  # dropped when asked for: its preload (and its inputs) goes too
    pool.labels["queued"] = "queued"
    pool.preloads["queued"] = preload("queued")
    assert pool.take("queued") is None and queued.cancelled() and "queued" not in pool.preloads
    pool.close()
    assert pool.preloads == {} and loaded == ["a", "broken", "b"]  # closed: none held, none run


def test_the_workers_triton_threads_from_the_environment(monkeypatch):
    from torch_stagehand.compiler.startup.ahead import _ahead_threads

    monkeypatch.delenv("STAGEHAND_AHEAD_THREADS", raising=False)
    assert _ahead_threads() == 0  # cores / workers
    monkeypatch.setenv("STAGEHAND_AHEAD_THREADS", "16")
    assert _ahead_threads() == 16
    monkeypatch.setenv("STAGEHAND_AHEAD_THREADS", "many")
    with pytest.raises(ValueError, match="STAGEHAND_AHEAD_THREADS must be an int >= 0, got 'many'"):
        _ahead_threads()


def test_a_worker_waits_for_a_graphs_kernels_at_the_jobs_end(monkeypatch):
    """Inductor's wait for a graph module's kernels (at its load) is put off until the job ends: the module keeps its
    futures meanwhile (the backward's lowering goes on), and at the end each becomes its kernel, in order."""
    from concurrent.futures import Future

    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    from torch_stagehand.compiler.startup import ahead_worker

    monkeypatch.setattr(AsyncCompile, "wait", AsyncCompile.wait)  # put back after the test
    monkeypatch.setattr(ahead_worker, "_WAIT", [])
    monkeypatch.setattr(ahead_worker, "_KERNEL_WAITS", [])
    ahead_worker.defer_kernel_waits()
    ahead_worker.defer_kernel_waits()  # twice: still one wait put off per module
    forward, backward = {"triton_fw": Future(), "n": 1}, {"triton_bw": Future()}
    with inductor_config.patch(compile_threads=2):  # Inductor resolves futures only with a pool
        AsyncCompile().wait(forward)
        AsyncCompile().wait(backward)
        assert isinstance(forward["triton_fw"], Future) and len(ahead_worker._KERNEL_WAITS) == 2
        forward["triton_fw"].set_result("fw kernel")
        backward["triton_bw"].set_result("bw kernel")
        ahead_worker.wait_for_kernels()
    assert forward == {"triton_fw": "fw kernel", "n": 1} and backward == {"triton_bw": "bw kernel"}
    assert ahead_worker._KERNEL_WAITS == []


def test_a_worker_loads_only_the_reductions_inductor_may_retune(monkeypatch):
    """A worker loads no kernel (it never runs one) but a looped reduction on CUDA with Inductor's occupancy
    re-tune on: that re-tune reads the loaded kernel's register count and compiles its extra config here, into
    Triton's cache, instead of in the main process's step. The re-tune itself stays Inductor's."""
    from types import SimpleNamespace

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner, HeuristicType

    from torch_stagehand.compiler.startup import ahead_worker

    loaded = []
    monkeypatch.setattr(CachingAutotuner, "_make_launchers", lambda self: loaded.append(self.name))
    retune = CachingAutotuner._dynamic_scale_rblock
    ahead_worker.load_only_rescalable_reductions()

    def autotuner(name, heuristic, device="cuda", **meta):
        tuner = object.__new__(CachingAutotuner)
        tuner.name, tuner.heuristic_type, tuner.inductor_meta = name, heuristic, meta
        tuner.device_props = SimpleNamespace(type=device)
        return tuner

    for tuner in [autotuner("layer_norm", HeuristicType.REDUCTION),
                  autotuner("rms_norm_rotary", HeuristicType.PERSISTENT_REDUCTION, persistent_reduction=True),
                  autotuner("persistent_flagged", HeuristicType.REDUCTION, persistent_reduction=True),
                  autotuner("gelu", HeuristicType.POINTWISE),
                  autotuner("retune_off", HeuristicType.REDUCTION, dynamic_scale_rblock=False),
                  autotuner("on_the_cpu", HeuristicType.REDUCTION, device="cpu")]:
        tuner._make_launchers()
    assert loaded == ["layer_norm"]
    assert CachingAutotuner._dynamic_scale_rblock is retune


def test_the_first_workers_share_the_w8a16_kernels_they_compile_as_they_start(monkeypatch, capsys):
    """Offload names the W8A16 kernels a cold step would compile itself (kernels/tuning/ahead.py): the first worker
    compiles the provisional one, each of the first `size` its share of the tuning candidates, a worker started
    after one left none. A worker that cannot compile them says why on its stderr and goes on (they only save the
    step compiles)."""
    from types import SimpleNamespace

    from torch_stagehand.compiler.startup import ahead

    from torch_stagehand.compiler.startup import ahead_worker

    started = []

    class Worker:
        def __init__(self, pool, w8a16=None):
            started.append(w8a16)
            self.process = SimpleNamespace(pid=len(started))

        def close_input(self):
            pass

        def end(self, deadline=None):
            pass

    monkeypatch.setattr(ahead, "_Worker", Worker)
    wanted = {"device": "cuda:0", "dtype": "bfloat16", "shapes": [(3072, 3072, True)]}
    pool = AheadCompiler(2, w8a16=wanted).start()
    pool.close()
    assert started == [dict(wanted, provisional=True, share=(0, 2)), dict(wanted, provisional=False, share=(1, 2))]
    assert pool._w8a16_share(2) is None and AheadCompiler(2)._w8a16_share(0) is None
    assert ahead_worker.compile_w8a16(None, None) == {}  # nothing asked: nothing done
    assert ahead_worker.compile_w8a16({"device": "cpu", "dtype": "no_such_dtype"}, None) == {}
    assert "no_such_dtype" in capsys.readouterr().err


def test_offload_names_the_w8a16_kernels_for_the_workers(monkeypatch):
    """What offload hands the workers to compile: on CUDA with INT8 blocks, the device, the activation dtype and
    the INT8 Linears' shapes; under precision="auto" (it starts in bf16) or STAGEHAND_AHEAD_TUNING=0 no shapes;
    nothing for bf16 or the CPU."""
    from types import SimpleNamespace

    from torch_stagehand.api import _w8a16_ahead

    linear = torch.nn.Linear(8, 8).to(torch.bfloat16)
    layers = [SimpleNamespace(block=0, out_features=96, in_features=32, experts=0, module=linear),
              SimpleNamespace(block=1, out_features=64, in_features=32, experts=0, module=linear)]
    cuda = torch.device("cuda")
    assert _w8a16_ahead(cuda, layers, {0: "int8", 1: "bf16"}, auto=False) == {
        "device": "cuda", "dtype": "bfloat16", "shapes": [(96, 32, True)]}
    assert _w8a16_ahead(cuda, layers, {0: "bf16", 1: "bf16"}, auto=True)["shapes"] == []
    assert _w8a16_ahead(cuda, layers, {0: "bf16", 1: "bf16"}, auto=False) is None
    assert _w8a16_ahead(torch.device("cpu"), layers, {0: "int8"}, auto=False) is None
    monkeypatch.setenv("STAGEHAND_AHEAD_TUNING", "0")
    assert _w8a16_ahead(cuda, layers, {0: "int8", 1: "bf16"}, auto=False)["shapes"] == []


def test_ahead_workers_option(monkeypatch):
    monkeypatch.delenv("STAGEHAND_AHEAD_WORKERS", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert BackendOptions().workers_ahead(cuda) == 2 and BackendOptions().workers_ahead(cpu) == 0  # the defaults
    assert BackendOptions.from_dict({"ahead_workers": 3}).workers_ahead(cpu) == 3
    assert BackendOptions(inner="eager", ahead_workers=2).workers_ahead(cuda) == 0  # eager keeps no cache to fill
    with pytest.raises(BackendOptionsError, match="ahead_workers"):
        BackendOptions.from_dict({"ahead_workers": -1})
    with pytest.raises(BackendOptionsError, match="ahead_workers"):
        BackendOptions.from_dict({"ahead_workers": True})


def test_ahead_workers_from_the_environment(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setenv("STAGEHAND_AHEAD_WORKERS", "1")
    assert BackendOptions().workers_ahead(cuda) == 1
    monkeypatch.setenv("STAGEHAND_AHEAD_WORKERS", "0")
    assert BackendOptions().workers_ahead(cuda) == 0  # the environment turns the default off
    assert BackendOptions(ahead_workers=2).workers_ahead(cuda) == 2  # the option wins
    monkeypatch.setenv("STAGEHAND_AHEAD_WORKERS", "many")
    with pytest.raises(ConfigError, match="STAGEHAND_AHEAD_WORKERS must be an int >= 0, got 'many'"):
        BackendOptions().workers_ahead(cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_workers_compile_ahead_and_hold_no_tensors_on_the_device(fresh_caches):
    """Three workers on CUDA: the training variant loads from what a worker compiled (Triton kernels for the
    device, from fake inputs) and trains as the variant the step compiles itself; a worker holds at most a CUDA
    context on the device (no tensor: fake inputs), measured by nvidia-smi while it is up."""
    import os
    import subprocess

    def run(options: dict):
        model, ids = _lora_qwen2(3)
        ids = ids.cuda()
        rt = stagehand.offload(model, device="cuda", verbose=False)
        torch._dynamo.reset()
        stagehand.compile_blocks(model, options={"recompute": "blocks", **options})
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        cache = variant_cache(rt)
        stats = None if cache.ahead is None else dict(cache.ahead.stats, size=cache.ahead.size)
        out = (loss.item(), _lora_grads(model), [dict(i) for i in cache.info.values()], stats)
        smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout.splitlines()
        rt.close()
        return out, {line.split(",")[0].strip(): int(line.split(",")[1]) for line in smi if "," in line}

    (loss, grads, infos, stats), smi = run({"ahead_workers": 3})
    assert stats["size"] == 3 and [i["cache"] for i in infos] == ["hit"], [i["ahead"] for i in infos]
    assert stats["refused"] == [] and stats["submitted"] == 2
    workers_mib = {pid: smi.get(str(pid), 0) for pid in stats["worker_pids"]}
    print("ahead workers' device memory (MiB, nvidia-smi):", workers_mib, "| all processes:", smi)
    assert all(mib < 1024 for mib in workers_mib.values()), workers_mib  # a context at most, no tensors
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh_caches / "inductor-serial")
    os.environ["TRITON_CACHE_DIR"] = str(fresh_caches / "triton-serial")
    os.environ["STAGEHAND_CACHE_DIR"] = str(fresh_caches / "stagehand-serial")  # not the bundle the run above wrote
    (serial_loss, serial_grads, serial_infos, none), _ = run({"ahead_workers": 0})
    assert none is None and [i["cache"] for i in serial_infos] == ["miss", "miss"]
    # The first forward ran eagerly with workers, compiled without (the backward is the same compiled variant).
    assert loss == pytest.approx(serial_loss, rel=1e-3)
    assert max(rel_err(grads[n], serial_grads[n]) for n in grads) < 1e-2


def test_no_workers_when_a_run_before_compiled_the_model(tmp_path):
    """A warm start loads its variants in a fraction of a second each: workers that would have to start first
    are not made. The first run of the model (no compile bundle yet) gets them."""
    from torch_stagehand.compiler.startup.compile_cache import CompileBundle
    from torch_stagehand.compiler.variants import VariantCache

    bundle = CompileBundle(str(tmp_path / "model.bundle"), torch.device("cpu"))
    first = VariantCache(bundle)
    (tmp_path / "model.bundle").write_bytes(b"written by the first run")
    assert first.use_ahead(3) is not None and first.ahead.workers == set()  # started at the first job only
    first.clear()
    assert VariantCache(bundle).use_ahead(3) is None
    assert VariantCache(None).use_ahead(0) is None


def test_inference_compiles_nothing_ahead(fresh_caches):
    """Under no_grad no backward follows: no training variant is foreseen, no worker starts."""
    model, ids = _lora_qwen2(2)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    stagehand.compile_blocks(model, options={"inner": "inductor", "ahead_workers": 2})
    with torch.no_grad():
        model(input_ids=ids)
    cache = variant_cache(rt)
    assert len(cache.info) == 1 and cache.ahead.stats["submitted"] == 0 and cache.ahead.workers == set()
    rt.restore()


def test_our_functions_in_a_graph_travel_by_name():
    """A variant graph calls our in-graph Linears (runtime/precision, big inputs): GraphPickler ships only ops and
    torch's functions, so ours travel by name and the worker imports them again: the same targets, the same code;
    GraphPickler itself is left as it was."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    from torch_stagehand.runtime.precision.int8 import int8_linear_in_graph

    graph = fx.Graph()
    x, slot = graph.placeholder("x"), graph.placeholder("slot")
    graph.output((graph.call_function(int8_linear_in_graph, (x, slot)), graph.call_function(torch.sin, (x,))))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    restored = GraphPickler.loads(pickle_graph(gm), FakeTensorMode())
    restored.recompile()
    assert restored.code == gm.code
    assert [n.target for n in restored.graph.nodes] == [n.target for n in gm.graph.nodes]
    with pytest.raises(NotImplementedError):  # outside pickle_graph, GraphPickler refuses our function as before
        GraphPickler.dumps(gm)


def test_offload_starts_the_workers_the_environment_asks_for_and_the_step_uses_them(fresh_caches, monkeypatch):
    """`STAGEHAND_AHEAD_WORKERS` set: offload starts the workers (they import torch while the host store fills, not
    while the first step waits), the model's variant cache takes them, and the step's job goes to one of them.
    A model compiled before (its bundle on disk) gets none; a backend option for another count replaces them."""
    monkeypatch.setenv("STAGEHAND_AHEAD_WORKERS", "1")
    model, ids = _lora_qwen2(2)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    started = variant_cache(rt).ahead
    assert started is not None and len(started.workers) == 1 and started.stats["submitted"] == 0
    pids = list(started.worker_pids)
    stagehand.compile_blocks(model, options={"inner": "inductor", "recompute": "blocks"})
    model(input_ids=ids, labels=ids).loss.backward()
    cache = variant_cache(rt)
    # The training variant and the inference variant went to the one worker; the backward loaded the first.
    assert cache.ahead is started and cache.ahead.worker_pids == pids and cache.ahead.stats["submitted"] == 2
    # A job still queued when the step needs it (its worker still starting, on a loaded machine) is dropped and
    # compiled here: the step's cache then misses. Otherwise the worker's compile is what the step loads.
    assert [i["cache"] for i in cache.info.values()] == (["miss"] if cache.ahead.dropped else ["hit"])
    rt.restore()
    assert not started.workers  # they end with the runtime that adopted them

    torch._dynamo.reset()
    model, ids = _lora_qwen2(2)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    assert variant_cache(rt).ahead is None  # the bundle the run above wrote: nothing to compile ahead
    rt.restore()

    for bundle in (fresh_caches / "stagehand" / "compile").glob("*.bundle"):
        bundle.unlink()
    model, ids = _lora_qwen2(2)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    assert variant_cache(rt).ahead is not None
    assert variant_cache(rt).use_ahead(2).size == 2  # the backend's option: two workers, not the environment's one
    rt.restore()
