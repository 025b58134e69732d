"""Profile the ahead-compile workers' jobs (compiler/startup/ahead_worker.py) under cProfile.

    python benches/ahead_profile.py DIR benches/start_time.py --rows flux --modes cold --ahead-workers 2

runs the script after DIR (with its arguments) with a `sitecustomize` first on PYTHONPATH, which every Python
process it starts inherits (an ahead worker gets its main process's sys.path). In a worker it runs the worker's
loop with each job under cProfile: `DIR/ahead-<pid>-<n>.txt` (n counts that worker's jobs) holds the job's label,
its seconds per phase of torch's compile (its `dynamo_timed` regions of 0.05 s or more, longest first; they nest),
its Triton kernels' compile seconds as Inductor reports them (count, sum, the five slowest), and the 40 costliest
calls by cumulative time. Another sitecustomize is shadowed for the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from torch_stagehand.runtime.atomic_file import write_atomic

WORKER_ARGS = ["-m", "torch_stagehand.compiler.startup.ahead_worker"]  # how ahead.py starts a worker

_SITECUSTOMIZE = """import sys
if sys.orig_argv[-2:] == {worker!r}:
    sys.path.insert(0, {here!r})
    import ahead_profile
    ahead_profile.run_worker({directory!r})
    sys.exit(0)
"""


_KERNEL_SECONDS: list[tuple[str, float]] = []  # (kernel, seconds) in the order Inductor reported them


def time_kernels() -> None:
    """Record each Triton kernel's compile seconds as Inductor reports them (`_add_triton_kernel_info`)."""
    from torch._inductor import async_compile

    report = getattr(async_compile, "_add_triton_kernel_info", None)
    if report is None:  # an Inductor without the hook: nothing recorded
        return

    def recording(kernel_name, info, *args, **kwargs):
        if isinstance(info, dict) and isinstance(info.get("compile_time_us"), (int, float)):
            _KERNEL_SECONDS.append((kernel_name, info["compile_time_us"] / 1e6))
        return report(kernel_name, info, *args, **kwargs)

    async_compile._add_triton_kernel_info = recording


def profiled(compile_job, directory: str):
    """`compile_job` under cProfile, its report written into `directory` after each job."""
    import cProfile
    import io
    import json
    import pstats

    from torch._dynamo.utils import compilation_time_metrics

    def run(job):
        profile = cProfile.Profile()
        before = {k: sum(v) for k, v in compilation_time_metrics.items()}
        first = len(_KERNEL_SECONDS)
        try:
            return profile.runcall(compile_job, job)
        finally:
            spent = {k: sum(v) - before.get(k, 0.0) for k, v in compilation_time_metrics.items()}
            phases = {k: round(s, 3) for k, s in sorted(spent.items(), key=lambda kv: -kv[1]) if s >= 0.05}
            done = _KERNEL_SECONDS[first:]
            kernels = {"count": len(done), "seconds": round(sum(s for _, s in done), 3),
                       "slowest": [[name, round(s, 3)] for name, s in sorted(done, key=lambda d: -d[1])[:5]]}
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
            os.makedirs(directory, exist_ok=True)
            n = sum(name.startswith(f"ahead-{os.getpid()}-") for name in os.listdir(directory))
            write_atomic(os.path.join(directory, f"ahead-{os.getpid()}-{n}.txt"),
                         f"{job.label}\nphases {json.dumps(phases)}\nkernels {json.dumps(kernels)}\n{text.getvalue()}")

    return run


def run_worker(directory: str) -> None:
    """A worker's loop (`ahead_worker.main`), its jobs profiled."""
    from torch_stagehand.compiler.startup import ahead_worker

    ahead_worker.compile_job = profiled(ahead_worker.compile_job, directory)
    time_kernels()
    ahead_worker.main()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    directory, command = os.path.abspath(argv[0]), argv[1:]
    with tempfile.TemporaryDirectory() as site:
        write_atomic(os.path.join(site, "sitecustomize.py"), _SITECUSTOMIZE.format(
            worker=WORKER_ARGS, here=os.path.dirname(os.path.abspath(__file__)), directory=directory))
        path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
        return subprocess.call([sys.executable, *command], env=dict(os.environ, PYTHONPATH=path))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
