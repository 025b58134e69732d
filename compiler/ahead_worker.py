"""A worker process of `ahead.AheadCompiler`: compiles unit variants into torch's caches, from their graph and a
description of their inputs, and says how it went.

Run as `python -m torch_stagehand.compiler.ahead_worker`. It reads jobs from stdin and answers on the stdout it
was started with (length-prefixed pickles, `ahead.send` / `ahead.receive`); anything else that writes to stdout
(a library's print) goes to stderr instead. A job: `AheadJob` (ahead.py). It compiles with the same
`inner.compile_unit` as the main process, from fake inputs with the job's exact sizes, strides, storage offsets,
dtypes, devices and grad flags, under the main process's Inductor and AOTAutograd config and its attention
backends (process_settings.py): the same cache keys and the same graph, so when the step reaches the variant the
main process loads what this wrote. It allocates no device tensor (fake
tensors) and loads no kernel (`load_no_kernels`); it reads nothing of the runtime (the variant passes ran in the
main process; the joint passes read only the graph).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any


def fake_inputs(specs: list) -> tuple[list, Any]:
    """The job's inputs as fake tensors in a fresh ShapeEnv (as `symbolic.fake_static` fakes real ones), and
    beside them the values `inner._bake_scalar_reads` reads (0-dim CPU tensors travel as they are)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from .symbolic import FakedInputs

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

    from . import compile_cache, inner, process_settings
    from .inner import compile_unit

    start = time.perf_counter()
    values, faked = fake_inputs(job.inputs)
    graph = GraphPickler.loads(job.graph, faked.mode)
    graph.recompile()
    if graph.code != job.code:
        raise RuntimeError("the graph unpickled to other code than the main process's (its cache key would differ)")
    process_settings.adopt(job.settings)  # the attention backends the main process allows, and the rest
    if job.cacheable:  # the main process's, not this one's (its imports registered other in-graph functions)
        inner.cacheable_functions = lambda: job.cacheable
    with torch.set_grad_enabled(job.grad), compile_cache.track() as outcome:
        compile_unit(graph, values, "inductor", lambda *_: None, job.joint_passes, replay_rng=job.replay_rng,
                     faked=faked)
    # Whether the compile opened a CUDA context here after all (0.5 GiB outside any budget): the log says so.
    context = torch.cuda.is_initialized() and any(
        torch._C._cuda_hasPrimaryContext(i) for i in range(torch.cuda.device_count()))
    return {"state": outcome.state, "seconds": time.perf_counter() - start, "cuda_context": context,
            "settings": process_settings.current()}


def load_no_kernels() -> None:
    """Compile Triton kernels to the cache, never load them: Inductor loads each kernel it compiled (its
    launchers), and loading one opens a CUDA context, 0.5 GiB of device memory per worker that no VRAM budget
    counts. The main process loads the kernels when it loads the variant, as a warm start does; Inductor's
    occupancy re-tuning (`_dynamic_scale_rblock`) runs there too, at that load."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    for name in ("_make_launchers", "_dynamic_scale_rblock"):
        if not hasattr(CachingAutotuner, name):  # another torch: say so rather than load kernels unseen
            raise RuntimeError(f"stagehand ahead worker: torch's CachingAutotuner has no {name}")
        setattr(CachingAutotuner, name, lambda self: None)


def main() -> None:
    from . import ahead

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the replies
    jobs = os.fdopen(sys.stdin.fileno(), "rb")
    configs = ahead.receive(jobs)
    import torch

    from torch_stagehand.runtime import experts, ops  # noqa: F401 - they register the stagehand ops the graphs call
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    inductor_config.load_config(configs["inductor"])
    functorch_config.load_config(configs["functorch"])
    load_no_kernels()
    if torch.cuda.is_available():  # Triton's compile workers, up while the first job is on its way
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
    from .inner import prewarm_compiler_imports

    prewarm_compiler_imports()  # Inductor's and AOTAutograd's modules and the cache keys' hashes, before a job waits
    if ahead._debug():
        import logging

        logging.basicConfig(level=logging.INFO)
        logging.getLogger("torch._functorch._aot_autograd.autograd_cache").setLevel(logging.DEBUG)
    while True:
        job = ahead.receive(jobs)
        if job is None:
            return
        try:
            reply = compile_job(job)
        except BaseException:  # noqa: BLE001 - the main process compiles the variant itself, and logs why
            reply = {"error": traceback.format_exc(limit=6)}
        ahead.send(replies, reply)


if __name__ == "__main__":
    main()
