"""A worker process of `ahead.AheadCompiler`: compiles unit variants into torch's caches, from their graph and a
description of their inputs, and says how it went.

Run as `python -m torch_stagehand.compiler.startup.ahead_worker`. It reads jobs from stdin and answers on the stdout it
was started with (length-prefixed pickles, `ahead_wire.send` / `ahead_wire.receive`); anything else that writes
to stdout (a library's print) goes to stderr instead. A job: `AheadJob` (compiler/startup/ahead.py). It compiles with the same
`inner.compile_unit` as the main process, from fake inputs with the job's exact sizes, strides, storage offsets,
dtypes, devices and grad flags, under the main process's Inductor and AOTAutograd config and its attention
backends (compiler/startup/process_settings.py): the same cache keys and the same graph, so when the step reaches the variant the
main process loads what this wrote. It allocates no device tensor (fake tensors) and loads no kernel but the
reductions Inductor re-tunes at their load (`load_only_rescalable_reductions`); it reads nothing of the runtime
(the variant passes ran in the main process; the joint passes read only the graph).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any
from torch_stagehand.environment import env


def fake_inputs(specs: list) -> tuple[list, Any]:
    """The job's inputs as fake tensors in a fresh ShapeEnv (as `symbolic.fake_static` fakes real ones), and
    beside them the values `inner._bake_scalar_reads` reads (0-dim CPU tensors travel as they are)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from torch_stagehand.compiler.symbolic import FakedInputs

    mode = FakeTensorMode(shape_env=ShapeEnv())
    storages: dict[int, torch.Tensor] = {}
    values, fakes = [], []
    for spec in specs:
        if spec[0] == "value":
            values.append(spec[1])
            fakes.append(spec[1] if not isinstance(spec[1], torch.Tensor) else mode.from_tensor(spec[1]))
            continue
        _, group, nbytes, size, stride, offset, dtype, device, requires_grad = spec
        with mode:
            if group not in storages:  # inputs that share a storage in the main process share one here
                storages[group] = torch.empty((nbytes,), dtype=torch.uint8, device=device)
            t = storages[group].view(dtype).as_strided(size, stride, offset)
        if requires_grad:
            t = t.detach().requires_grad_()
        values.append(t)
        fakes.append(t)
    return values, FakedInputs(mode, fakes)


def compile_job(job) -> dict:
    """Compile one job's variant; what the main process logs about it."""
    import torch
    from torch.fx._graph_pickler import GraphPickler

    from torch_stagehand.compiler import inner

    from torch_stagehand.compiler.startup import compile_cache

    from torch_stagehand.compiler.startup import process_settings
    from torch_stagehand.compiler.inner import compile_unit

    from torch._dynamo.utils import compilation_time_metrics

    start = time.perf_counter()
    before = {k: sum(v) for k, v in compilation_time_metrics.items()}
    first_kernel = len(_KERNEL_SECONDS)
    values, faked = fake_inputs(job.inputs)
    graph = GraphPickler.loads(job.graph, faked.mode)
    graph.recompile()
    if graph.code != job.code:
        raise RuntimeError("the graph unpickled to other code than the main process's (its cache key would differ)")
    process_settings.adopt(job.settings)  # the attention backends the main process allows, and the rest
    if job.cacheable:  # the main process's, not this one's (its imports registered other in-graph functions)
        inner.cacheable_functions = lambda: job.cacheable
    try:
        with torch.set_grad_enabled(job.grad), compile_cache.track() as outcome:
            compile_unit(graph, values, "inductor", lambda *_: None, job.joint_passes, replay_rng=job.replay_rng,
                         faked=faked)
    finally:
        wait_for_kernels()  # the job is done when its kernels are in Triton's cache (`defer_kernel_waits`)
    # Whether the compile opened a CUDA context here after all (0.5 GiB outside any budget): the log says so.
    context = torch.cuda.is_initialized() and any(
        torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count()))
    return {"state": outcome.state, "seconds": time.perf_counter() - start, "cuda_context": context,
            "settings": process_settings.current(), "phases": phase_seconds(before, compilation_time_metrics),
            "kernels": kernel_seconds(first_kernel)}


def phase_seconds(before: dict[str, float], metrics: dict[str, list[float]], least_s: float = 0.05) -> dict:
    """The job's seconds per phase of torch's compile (its `dynamo_timed` regions: AOTAutograd's trace and
    partition, Inductor's lowering, code generation, the wait for Triton's compile pool...), the phases of at
    least `least_s`, longest first. Regions nest: the phases overlap, and do not add up to the job."""
    spent = {k: sum(v) - before.get(k, 0.0) for k, v in metrics.items()}
    return {k: round(s, 3) for k, s in sorted(spent.items(), key=lambda kv: -kv[1]) if s >= least_s}


_KERNEL_WAITS: list[tuple[Any, dict]] = []  # (AsyncCompile, a graph module's globals) whose kernels are not waited for
_WAIT = []  # Inductor's own AsyncCompile.wait, once `defer_kernel_waits` replaced it


def defer_kernel_waits() -> None:
    """Let each graph's Triton kernels compile while the job goes on, and wait for them all at its end
    (`wait_for_kernels`). Inductor waits for a graph's kernels as it loads the graph's module (its
    `async_compile.wait(globals())`), before AOTAutograd goes on to the backward graph, whose tracing and lowering
    need none of them: full-size Flux's single block waited 4.1 s there for one kernel (its q/k RMSNorm fused
    with the rotary embedding, a persistent reduction) while the backward stood still. A worker never runs the
    module it loads, so nothing reads the futures left in the kernels' places until the wait at the end. Measured
    there: the forward's compile 2.0 s instead of 5.2 s, the job 9.9 s instead of 10.2 s (the backward's own
    rotary kernel then ends it; `inner.one_config_per_kernel` shortens both)."""
    from torch._inductor.async_compile import AsyncCompile

    if _WAIT:
        return
    _WAIT.append(AsyncCompile.wait)

    def later(self, scope: dict) -> None:
        _KERNEL_WAITS.append((self, scope))

    AsyncCompile.wait = later


def wait_for_kernels() -> None:
    """Inductor's waits `defer_kernel_waits` put off, in order: each module's futures become its kernels."""
    while _KERNEL_WAITS:
        compiler, scope = _KERNEL_WAITS.pop(0)
        _WAIT[0](compiler, scope)


_KERNEL_SECONDS: list[tuple[str, float]] = []  # (kernel, seconds) in the order Inductor reported them


def time_kernels() -> None:
    """Record each Triton kernel's compile seconds as Inductor reports them to its metrics
    (`async_compile._add_triton_kernel_info`, once per kernel its compile pool built, with the pool process's own
    seconds for it): which kernels a job's wait on the pool (`async_compile.wait`) was spent on. An Inductor
    without the hook records nothing."""
    from torch._inductor import async_compile

    report = getattr(async_compile, "_add_triton_kernel_info", None)
    if report is None:
        return

    def recording(kernel_name, info, *args, **kwargs):
        if isinstance(info, dict) and isinstance(info.get("compile_time_us"), (int, float)):
            _KERNEL_SECONDS.append((kernel_name, info["compile_time_us"] / 1e6))
        return report(kernel_name, info, *args, **kwargs)

    async_compile._add_triton_kernel_info = recording


def kernel_seconds(first: int, slowest: int = 5) -> dict:
    """The kernels compiled since `first` (`time_kernels`): how many, their seconds added up (the pool runs them
    side by side), and the `slowest` longest."""
    done = _KERNEL_SECONDS[first:]
    return {"count": len(done), "seconds": round(sum(s for _, s in done), 3),
            "slowest": [[name, round(s, 3)] for name, s in sorted(done, key=lambda d: -d[1])[:slowest]]}


def load_only_rescalable_reductions() -> None:
    """Compile Triton kernels to the cache and load none, but the reductions Inductor may re-tune for occupancy.

    Inductor loads each kernel it compiled (its launchers); a worker never runs one, and the main process loads
    them when it loads the variant, as a warm start does. But at a reduction's load Inductor reads the kernel's
    register count and, where occupancy is low, compiles one more config with half the reduction block
    (`_dynamic_scale_rblock`): on full-size Flux's cold first step, five (int8) to seven (bf16) layer-norm
    reductions, 1.0-2.1 s of the main process while it loaded the workers' variants (`main_triton_compiles` in
    benches/results/start_time_hints_flux*.json). So a worker loads those reductions and lets the re-tune compile
    here, into Triton's cache: the main process's re-tune finds the same register count, asks for the same
    config, and reads it back. (A worker holds a CUDA context anyway: Inductor's compile for the device opens it.)"""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner, HeuristicType

    for name in ("_make_launchers", "_dynamic_scale_rblock"):
        if not hasattr(CachingAutotuner, name):  # another torch: say so rather than load kernels unseen
            raise RuntimeError(f"stagehand ahead worker: torch's CachingAutotuner has no {name}")
    make_launchers = CachingAutotuner._make_launchers

    def reductions_only(self) -> None:
        if rescalable(self, HeuristicType.REDUCTION):
            make_launchers(self)

    CachingAutotuner._make_launchers = reductions_only


def rescalable(autotuner, reduction) -> bool:
    """Might Inductor's occupancy re-tune give `autotuner` another config (its own first conditions: a looped
    reduction on a CUDA device, the re-tune not turned off)? `reduction`: Inductor's HeuristicType.REDUCTION."""
    meta = autotuner.inductor_meta or {}
    return (autotuner.heuristic_type == reduction and not meta.get("persistent_reduction")
            and meta.get("dynamic_scale_rblock", True) and getattr(autotuner.device_props, "type", None) == "cuda")


def compile_w8a16(wanted: dict | None, jobs) -> dict:
    """`wanted` (AheadCompiler's `w8a16` share): compile into Triton's cache the W8A16 kernels a cold step would
    compile itself: the kernel its eager forward runs for the keys it defers (`provisional`:
    kernels/launch.compile_provisional), and this worker's share of the INT8 Linears' tuning candidates
    (kernels/tuning/ahead.py), until a job arrives on `jobs` (the rest the step's tuner compiles). Only a head
    start: a failure is printed on this worker's stderr and the worker goes on. Returns what it compiled."""
    if not wanted:
        return {}
    import select

    import torch

    from torch_stagehand.kernels.tuning import ahead as ahead_tuning

    from torch_stagehand.kernels.tuning import autotune as tune
    from torch_stagehand.kernels.launch import compile_provisional

    done: dict = {}
    try:
        device, dtype = torch.device(wanted["device"]), getattr(torch, wanted["dtype"])
        if wanted.get("provisional"):
            done["provisional"] = compile_provisional(device, dtype)
        index, count = wanted.get("share", (0, 1))
        launches = ahead_tuning.candidate_launches(wanted.get("shapes", []), dtype, device)[index::count]
        if launches:
            # The stream is read only after this: a job waiting in the pipe is what stops the compiles.
            waiting = lambda: bool(select.select([jobs], [], [], 0)[0])  # noqa: E731
            done.update(ahead_tuning.compile_candidates(launches, device, max(1, tune.precompile_threads() // count),
                                                        stop=waiting))
    except Exception:  # noqa: BLE001 - only a head start
        traceback.print_exc()
    return done


def profiled(compile_fn, job, directory: str) -> dict:
    """`compile_fn(job)`; with `directory` (`STAGEHAND_AHEAD_PROFILE`), under cProfile, its 40 costliest calls
    written to `<directory>/ahead-<pid>-<n>.txt` (n counts this worker's jobs) with the job's label on top."""
    if not directory:
        return compile_fn(job)
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    try:
        return profile.runcall(compile_fn, job)
    finally:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
        os.makedirs(directory, exist_ok=True)
        n = sum(name.startswith(f"ahead-{os.getpid()}-") for name in os.listdir(directory))
        with open(os.path.join(directory, f"ahead-{os.getpid()}-{n}.txt"), "w") as f:
            f.write(f"{job.label}\n{text.getvalue()}")


def main() -> None:
    from torch_stagehand.compiler.startup import ahead
    from torch_stagehand.compiler.startup import ahead_wire

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the replies
    jobs = os.fdopen(sys.stdin.fileno(), "rb")
    configs = ahead_wire.receive(jobs)
    import torch

    from torch_stagehand.runtime import ops  # noqa: F401 - they register the stagehand ops the graphs call

    from torch_stagehand.runtime.experts import stacks as experts  # noqa: F401 - it registers the experts' op
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    inductor_config.load_config(configs["inductor"])
    functorch_config.load_config(configs["functorch"])
    load_only_rescalable_reductions()
    time_kernels()
    defer_kernel_waits()
    if torch.cuda.is_available():  # Triton's compile workers, up while the first job is on its way
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
    from torch_stagehand.compiler.inner import prewarm_compiler_imports

    prewarm_compiler_imports()  # Inductor's and AOTAutograd's modules and the cache keys' hashes, before a job waits
    compile_w8a16(configs.get("w8a16"), jobs)
    if ahead._debug():
        import logging

        logging.basicConfig(level=logging.INFO)
        logging.getLogger("torch._functorch._aot_autograd.autograd_cache").setLevel(logging.DEBUG)
    while True:
        job = ahead_wire.receive(jobs)
        if job is None:
            return
        try:
            reply = profiled(compile_job, job, env("STAGEHAND_AHEAD_PROFILE") or "")
        except BaseException:  # noqa: BLE001 - the main process compiles the variant itself, and logs why
            reply = {"error": traceback.format_exc(limit=6)}
        ahead_wire.send(replies, reply)


if __name__ == "__main__":
    main()
