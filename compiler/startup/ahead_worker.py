"""A worker process of `ahead.AheadCompiler` (`python -m torch_stagehand.compiler.startup.ahead_worker`): jobs on
stdin, replies on stdout (`ahead_wire`; a stray print goes to stderr). It compiles each variant into torch's caches
with the main process's `inner.compile_unit`, config and settings, from fake inputs of the same metadata, so the
cache keys match; it allocates no device tensor and reads nothing of the runtime.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any


def fake_inputs(specs: list) -> tuple[list, Any]:
    """(values for `inner._bake_scalar_reads`, the inputs faked in a fresh ShapeEnv as `symbolic.fake_static` does)."""
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
    from torch_stagehand.compiler.startup import compile_cache, process_settings

    start = time.perf_counter()
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
            inner.compile_unit(graph, values, "inductor", lambda *_: None, job.joint_passes,
                               replay_rng=job.replay_rng, faked=faked)
    finally:
        wait_for_kernels()  # the job is done when its kernels are in Triton's cache (`defer_kernel_waits`)
    # Whether the compile opened a CUDA context here after all (0.5 GiB outside any budget): the log says so.
    context = torch.cuda.is_initialized() and any(
        torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count()))
    return {"state": outcome.state, "seconds": time.perf_counter() - start, "cuda_context": context,
            "settings": process_settings.current()}


_KERNEL_WAITS: list[tuple[Any, dict]] = []  # (AsyncCompile, a graph module's globals) whose kernels are not waited for
_WAIT = []  # Inductor's own AsyncCompile.wait, once `defer_kernel_waits` replaced it


def defer_kernel_waits() -> None:
    """Let each graph's Triton kernels compile while the job goes on (Inductor waits for them as it loads the
    graph's module, before the backward, which needs none), and wait for all at its end (`wait_for_kernels`)."""
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


def load_only_rescalable_reductions() -> None:
    """Compile Triton kernels to the cache and load none but the reductions Inductor may re-tune for occupancy
    (`_dynamic_scale_rblock` at load): loaded here, that config lands in the cache for the main process's re-tune."""
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
    """Might Inductor's occupancy re-tune give `autotuner` (a looped CUDA reduction) another config?"""
    meta = autotuner.inductor_meta or {}
    return (autotuner.heuristic_type == reduction and not meta.get("persistent_reduction")
            and meta.get("dynamic_scale_rblock", True) and getattr(autotuner.device_props, "type", None) == "cuda")


def compile_w8a16(wanted: dict | None, jobs) -> dict:
    """Compile into Triton's cache the W8A16 kernels of `wanted` (AheadCompiler's share) a cold step would: the
    `provisional` one, and this worker's share of the tuning candidates until a job arrives on `jobs`. Only a head
    start: a failure is printed on stderr. Returns what it compiled."""
    if not wanted:
        return {}
    import select

    import torch

    from torch_stagehand.kernels.launch import compile_provisional
    from torch_stagehand.kernels.tuning import ahead as ahead_tuning, autotune as tune

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


def main() -> None:
    from torch_stagehand.compiler.startup import ahead_wire
    from torch_stagehand.environment import env

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the replies
    jobs = os.fdopen(sys.stdin.fileno(), "rb")
    configs = ahead_wire.receive(jobs)
    import torch
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from torch_stagehand.runtime import ops  # noqa: F401 - they register the stagehand ops the graphs call
    from torch_stagehand.runtime.experts import stacks  # noqa: F401 - it registers the experts' op

    inductor_config.load_config(configs["inductor"])
    functorch_config.load_config(configs["functorch"])
    load_only_rescalable_reductions()
    defer_kernel_waits()
    if torch.cuda.is_available():  # Triton's compile workers, up while the first job is on its way
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
    from torch_stagehand.compiler.inner import prewarm_compiler_imports

    prewarm_compiler_imports()  # Inductor's and AOTAutograd's modules and the cache keys' hashes, before a job waits
    compile_w8a16(configs.get("w8a16"), jobs)
    if env("STAGEHAND_AHEAD_DEBUG"):
        import logging

        logging.basicConfig(level=logging.INFO)
        logging.getLogger("torch._functorch._aot_autograd.autograd_cache").setLevel(logging.DEBUG)
    while True:
        job = ahead_wire.receive(jobs)
        if job is None:
            return
        try:
            reply = compile_job(job)
        except BaseException:  # noqa: BLE001 - the main process compiles the variant itself, and logs why
            reply = {"error": traceback.format_exc(limit=6)}
        ahead_wire.send(replies, reply)


if __name__ == "__main__":
    main()
