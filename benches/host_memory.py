"""Host memory of offload and training (issue 13): pinned bytes, peak RSS, bytes per copy kind, step time.

    python benches/host_memory.py --model flux --runs int8 bf16 --out benches/results/host_memory_flux.json
    python benches/host_memory.py --model qwen --runs int8 int8:file bf16
    python benches/host_memory.py --model flux --runs int8 --cgroup-gb 32    # each run inside a 32 GB cgroup
    python benches/host_memory.py --model flux --runs int8@32 int8:ram       # the first inside 32 GB, the second free
    python benches/host_memory.py --model flux --runs disk                     # the disk tier (its own model)
    python benches/host_memory.py --model qwen --tiny --device cpu             # a smoke test of the bench itself

The model (benches/models.py: Flux-dev size from diffusers, Qwen2.5-7B shape
from transformers) is built with random init on the device and saved with its
own `save_pretrained` (safetensors shards + index json), so the load path is
measured as a user meets it. Each run is a fresh process (its RSS is its own):
the model is built on the meta device (`accelerate.init_empty_weights()`),
`offload(model, checkpoint=folder, precision=..., keep_full=...)` builds the
host store from the file tensor by tensor, peft LoRA r=16 goes on the
attention projections, and AdamW trains them under `torch.compile(backend=
"stagehand")` with the model's gradient checkpointing.

Per run: the pinned bytes asked for and locked, what PyTorch's caching host
allocator would have pinned for the same buffers the old way (every block's
bf16 and, for int8, int8 buffer, each rounded up to a power of two), peak RSS
while offloading and while training (VmHWM, reset in between), the final RSS,
`stats()["host"]["bytes_by_kind"]`, offload seconds, and the median step time;
then, in the same process and on the same compiled program, every master is
page-locked as well (keep_full="pinned", the old footprint without the
rounding) and the step time measured again: the ratio says whether pinning
less costs speed. Results: one table, JSON beside it.

The run "disk" measures the disk tier on a stack of 16 Flux single-block-sized
MLPs (1.2 GB of INT8): a slab is built, then the same compiled training step
runs with the INT8 rows in RAM and with them read from the slab file
(`Config(int8_tier="disk")`), the file's pages dropped from the page cache
(posix_fadvise DONTNEED) before every step; the tier's read GB/s and the step
time ratio go in their own table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from _common import RESULTS, env_info, print_header, print_table, proc_status, reset_host_peak, write_json

GB = 1e9
DIGITS = 2  # --tiny: 6 (its models are kilobytes)


CGROUP_ROOT = "/sys/fs/cgroup"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enable_memory_controller(root: str) -> None:
    """cgroup v2 lets a group hand the memory controller to children only while it holds no process itself
    (a container's root is such a group): move every process of the root into a leaf first, then enable it."""
    with open(os.path.join(root, "cgroup.subtree_control")) as f:
        if "memory" in f.read().split():
            return
    leaf = os.path.join(root, "stagehand_rest")
    os.makedirs(leaf, exist_ok=True)
    with open(os.path.join(root, "cgroup.procs")) as f:
        pids = f.read().split()
    for pid in pids:
        try:
            _write(os.path.join(leaf, "cgroup.procs"), pid)
        except OSError:  # a kernel thread or a process gone since
            pass
    _write(os.path.join(root, "cgroup.subtree_control"), "+memory")


def enter_cgroup(gb: float) -> tuple[str, str | None]:
    """Put this process in a new cgroup (v2) with memory.max = gb * 1e9 bytes and no swap.

    Returns (what happened, the cgroup's folder or None). The limit is the whole footprint the kernel charges:
    anonymous memory, page-locked memory and the page cache this process reads through (reclaimable)."""
    path = os.path.join(CGROUP_ROOT, f"stagehand_hostmem_{os.getpid()}")
    try:
        _enable_memory_controller(CGROUP_ROOT)
        os.mkdir(path)
        _write(os.path.join(path, "memory.max"), str(int(gb * GB)))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            _write(os.path.join(path, "memory.swap.max"), "0")
        _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
        return f"in cgroup {path}, memory.max {gb} GB, no swap", path
    except OSError as e:
        return f"no cgroup ({type(e).__name__}: {e})", None


def cgroup_figures(path: str) -> dict:
    """The cgroup's own account at the end of the run: its peak (kernel >= 5.19) and OOM events."""
    out = {}
    for name in ("memory.peak", "memory.current", "memory.max"):
        try:
            with open(os.path.join(path, name)) as f:
                out[name.replace(".", "_") + "_gb"] = round(int(f.read().strip()) / GB, DIGITS)
        except (OSError, ValueError):
            pass
    try:
        with open(os.path.join(path, "memory.events")) as f:
            events = dict(line.split() for line in f if line.strip())
        out["oom_events"] = int(events.get("oom", 0))
        out["oom_kills"] = int(events.get("oom_kill", 0))
    except OSError:
        pass
    return out


def pow2_pinned(rt) -> int:
    """What the old store pinned: each block's bf16 and (int8 runs) int8 buffer, each a power-of-two block."""
    total = 0
    for b in range(len(rt.blocks)):
        for p in {"bf16", rt.precision[b]}:
            n = rt.block_nbytes(b, p)
            total += 1 << (n - 1).bit_length()
    return total


# ---- the parent: build and save once, one child process per run -----------------------------------------


def save_model(args) -> tuple[str, float]:
    import models

    folder = os.path.join(args.work, f"{args.model}{'_tiny' if args.tiny else ''}")
    marker = os.path.join(folder, ".complete")
    if os.path.exists(marker):
        print(f"reusing the checkpoint in {folder}", flush=True)
        return folder, 0.0
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, _, _ = (models.build_flux if args.model == "flux" else models.build_qwen)(args.tiny, args.device)
    built = time.perf_counter() - t0
    model.save_pretrained(folder, max_shard_size="5GB")
    open(marker, "w").close()
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"built in {built:.1f} s, saved {size / GB:.2f} GB to {folder} in {time.perf_counter() - t0 - built:.1f} s",
          flush=True)
    return folder, round(time.perf_counter() - t0, 1)


def parent(args) -> int:
    env = print_header(env_info())
    folder, save_s = save_model(args) if any(r != "disk" for r in args.runs) else ("", 0.0)
    results = {"env": env, "model": args.model, "tiny": args.tiny, "checkpoint": folder, "save_s": save_s, "runs": []}
    out = args.out or os.path.join(RESULTS, f"host_memory_{args.model}{'_tiny' if args.tiny else ''}.json")
    for run in args.runs:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", run, "--model", args.model, "--device", args.device,
               "--work", args.work, "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
        if args.cgroup_gb:
            cmd += ["--cgroup-gb", str(args.cgroup_gb)]
        print(f"\n== run {run}: {' '.join(cmd[2:])}", flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stdout:  # the child's progress as it happens; its result line kept
            if line.startswith("RESULT "):
                lines.append(line)
            else:
                print(line, end="", flush=True)
        proc.wait()
        row = json.loads(lines[-1][7:]) if lines else {"run": run, "error": f"exit {proc.returncode}"}
        if proc.returncode and "error" not in row:
            row["error"] = f"exit {proc.returncode}" + (" (killed: out of memory?)" if proc.returncode == -9 else "")
        results["runs"].append(row)
        write_json(out, results)  # after every run: a later run cut off by a time limit loses only itself
    cols = ["run", "keep_full", "streamed_gb", "pinned_gb", "locked_gb", "old_pinned_gb", "locked_vs_streamed",
            "peak_rss_offload_gb", "rss_after_offload_gb", "peak_vs_final", "peak_rss_train_gb", "offload_s", "step_ms",
            "step_ms_all_pinned", "ratio", "cgroup_gb", "memory_peak_gb", "oom_kills", "error"]
    print_table([[r.get(c, "") for c in cols] for r in results["runs"] if r["run"] != "disk"], headers=cols,
                title=f"{args.model}{' (tiny)' if args.tiny else ''}: host memory, {env['device']}")
    disk = [r for r in results["runs"] if r["run"] == "disk"]
    if disk:
        dcols = ["blocks", "int8_gb", "evicted", "step_ms_ram", "step_ms_disk", "ratio", "reads", "read_gbps", "ready",
                 "waited", "slab_build_s", "error"]
        print_table([[r.get(c, "") for c in dcols] for r in disk], headers=dcols,
                    title="disk tier: INT8 from the slab file (page cache dropped before each step) vs from RAM")
    for r in results["runs"]:
        if r.get("bytes_by_kind"):
            print(f"{r['run']}: " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in r["bytes_by_kind"].items()))
    write_json(out, results)
    if args.cleanup:
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if all("error" not in r for r in results["runs"]) else 1


# ---- a child: one run, in its own process --------------------------------------------------------------


def meta_model(kind: str, tiny: bool):
    from accelerate import init_empty_weights

    import models

    if kind == "flux":
        from diffusers import FluxTransformer2DModel

        cfg = models.flux_config(tiny)
        with init_empty_weights():
            model = FluxTransformer2DModel(**cfg).to(torch.bfloat16)
        return model, lambda device: models.flux_inputs(cfg, tiny, device)[0]
    from transformers import Qwen2ForCausalLM

    config = models.qwen_config(tiny)
    with init_empty_weights():
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return model, lambda device: models.qwen_inputs(config, tiny, device)[0]


def child(args) -> dict:
    import peft

    import models
    import torch_stagehand as stagehand

    spec, _, limit = args.child.partition("@")  # "int8:file@32": precision, keep_full, a cgroup of 32 GB
    precision, _, keep_full = spec.partition(":")
    row: dict = {"run": args.child}
    cgroup, cgroup_gb = None, float(limit) if limit else args.cgroup_gb
    if cgroup_gb:
        row["cgroup"], cgroup = enter_cgroup(cgroup_gb)
        row["cgroup_gb"] = cgroup_gb
        print(row["cgroup"], flush=True)
    device = args.device
    sync = models.Sync(device)
    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11's cuDNN SDPA backward faults at Flux's shape
        torch.zeros(1, device=device)  # the CUDA context is part of the baseline, not of offload
    row["rss_before_gb"] = round(proc_status()["VmRSS"] / GB, DIGITS)
    model, make_inputs = meta_model(args.model, args.tiny)
    row["peak_reset"] = reset_host_peak(free_pinned_cache=False)
    t0 = time.perf_counter()
    rt = stagehand.offload(model, device=device, precision=precision, keep_full=keep_full or None,
                           checkpoint=os.path.join(args.work, f"{args.model}{'_tiny' if args.tiny else ''}"))
    sync()
    row["offload_s"] = round(time.perf_counter() - t0, 1)
    st = proc_status()
    host = rt.stats()["host"]
    streamed = sum(rt.block_nbytes(b, rt.precision[b]) for b in range(len(rt.blocks)))
    row.update(
        keep_full=host["keep_full"], streamed_gb=round(streamed / GB, DIGITS),
        pinned_gb=round(host["pinned_requested_bytes"] / GB, DIGITS), locked_gb=round(host["pinned_locked_bytes"] / GB, DIGITS),
        old_pinned_gb=round(pow2_pinned(rt) / GB, DIGITS), host_allocations=host["host_allocations"],
        locked_vs_streamed=round(host["pinned_locked_bytes"] / streamed, 3) if host["pinned_locked_bytes"] else None,
        bytes_by_kind=host["bytes_by_kind"], peak_rss_offload_gb=round(st["VmHWM"] / GB, DIGITS),
        rss_after_offload_gb=round(st["VmRSS"] / GB, DIGITS), rss_anon_gb=round(st["RssAnon"] / GB, DIGITS),
        rss_file_gb=round(st["RssFile"] / GB, DIGITS), peak_vs_final=round(st["VmHWM"] / max(1, st["VmRSS"]), 3),
    )
    print({k: v for k, v in row.items() if k != "bytes_by_kind"}, flush=True)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=models.LORA_TARGETS[args.model]))
    model.to(device)  # the adapters (the streamed weights stay in the host store)
    models.set_checkpointing(args.model, model, True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    rt.attach(optimizer)
    compiled = torch.compile(model, backend="stagehand")
    inputs = make_inputs(device)
    step = models.make_step(args.model, model, compiled, inputs, optimizer)
    reset_host_peak(free_pinned_cache=False)
    measured = models.measure(f"stagehand {precision}", step, args.steps, sync, rt)
    st = proc_status()
    row.update(step_ms=measured["step_ms"], first_step_s=measured["first_step_s"], peak_gib=measured["peak_gib"],
               peak_rss_train_gb=round(st["VmHWM"] / GB, DIGITS), rss_train_gb=round(st["VmRSS"] / GB, DIGITS))
    if host["keep_full"] != "file":  # the same program with every master locked too: does pinning less cost speed?
        rt.store.keep_full = "pinned"
        rt.store.set_pins(rt.precision)
        row["locked_all_gb"] = round(rt.stats()["host"]["pinned_locked_bytes"] / GB, DIGITS)
        again = models.measure(f"stagehand {precision}, all pinned", step, args.steps, sync, rt)
        row["step_ms_all_pinned"] = again["step_ms"]
        row["ratio"] = round(row["step_ms"] / again["step_ms"], 3)
    if cgroup:
        row.update(cgroup_figures(cgroup))
    return row


class _Mlp(torch.nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Stack(torch.nn.Module):
    """Flux single-block-sized MLPs (3072 -> 12288 -> 3072): 75 MB of INT8 per block."""

    def __init__(self, n: int, d: int, hidden: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Mlp(d, hidden) for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _evict(path: str) -> bool:
    """Drop a file's pages from the page cache (no root needed for clean pages): the next read is the disk's."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def disk_child(args) -> dict:
    """The disk tier: INT8 blocks from the slab file (page cache dropped before every step) vs the slab in RAM."""
    import models
    import torch_stagehand as stagehand
    from torch_stagehand.runtime.slab import build_slab_from_module

    n, d, hidden = (6, 64, 256) if args.tiny else (16, 3072, 12288)
    device, sync = args.device, models.Sync(args.device)
    torch.manual_seed(0)
    model = _Stack(n, d, hidden).to(torch.bfloat16).requires_grad_(False)
    folder = os.path.join(args.work, f"disk_slab{'_tiny' if args.tiny else ''}")
    t0 = time.perf_counter()
    result = build_slab_from_module(model, folder, "stack", "stack", include_prefixes=("blocks.",), quantizer="absmax",
                                    compare_quantizers=False, print_report=False, progress=False)
    row: dict = {"run": "disk", "blocks": n, "slab_build_s": round(time.perf_counter() - t0, 1)}
    slab_file = result.manifest_path.replace(".manifest.json", ".safetensors")
    x = torch.randn(1, 64 if args.tiny else 4096, d, dtype=torch.bfloat16, device=device, requires_grad=True)

    def timed(rt, compiled, evict: bool) -> float:
        times = []
        for _ in range(args.steps + 1):
            row["evicted"] = _evict(slab_file) if evict else False
            t = time.perf_counter()
            compiled(x).float().square().mean().backward()
            sync()
            times.append((time.perf_counter() - t) * 1e3)
        return round(sorted(times[1:])[len(times[1:]) // 2], 1)

    for tier in ("ram", "disk"):
        twin = copy.deepcopy(model)
        rt = stagehand.offload(twin, device=device, precision="int8", slab=result.manifest_path,
                               config=stagehand.Config(int8_tier=tier))
        torch._dynamo.reset()
        row[f"step_ms_{tier}"] = timed(rt, torch.compile(twin, backend="stagehand"), evict=tier == "disk")
        if tier == "disk":
            row.update(rt.stats()["host"]["disk_tier"])
            row["int8_gb"] = round(rt.stats()["host"]["bytes_by_kind"]["int8 disk"] / GB, DIGITS)
        rt.restore()
    row["ratio"] = round(row["step_ms_disk"] / row["step_ms_ram"], 3)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["flux", "qwen"], required=True)
    parser.add_argument("--runs", nargs="+", default=["int8", "bf16"],
                        help="precision[:keep_full][@GB], e.g. int8, int8:file, int8:pinned, bf16, int8@32 (inside a 32 GB "
                             "cgroup); or disk (the disk tier)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a small config of the same classes (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "stagehand_hostmem"),
                        help="where the checkpoint is saved (reused when complete)")
    parser.add_argument("--cgroup-gb", type=float, default=None, help="run each child inside a cgroup of this size")
    parser.add_argument("--cleanup", action="store_true", help="delete the saved checkpoint at the end")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global DIGITS
    DIGITS = 6 if args.tiny else 2
    if args.child:
        try:
            row = disk_child(args) if args.child == "disk" else child(args)
        except Exception as e:  # noqa: BLE001 - the parent reports it in the table
            import traceback

            traceback.print_exc()
            row = {"run": args.child, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
