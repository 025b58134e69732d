"""Training on several GPUs of one node: DistributedDataParallel (NCCL) over the backend, one host store per node.

    python benches/multi_gpu.py --gpus 1 2 --budget 16 --out benches/results/multi_gpu_flux.json
    python benches/multi_gpu.py --workload fullft --gpus 1 2 --budget 24 --deepspeed 2 \
        --out benches/results/multi_gpu_qwen_fullft.json
    python benches/multi_gpu.py --gpus 1 2 --tiny          # a smoke test of the bench itself (CPU: gloo)

`--workload lora` (default). Each row is a fresh `torchrun --nproc_per_node=N` job: every rank builds Flux-dev 12B (diffusers
`FluxTransformer2DModel`, random init on its GPU, bf16) with peft LoRA r=16 on the attention projections,
`offload(precision="int8", vram_budget=...)`, `stagehand.compile_blocks` (one Dynamo graph per block
structure), `DistributedDataParallel` on its GPU, AdamW on the adapters, the model's own checkpointing on,
batch 1 of 4096 image + 512 text tokens per rank. The ranks of the node share one host store
(`Config.node_shared_store="auto"`; `--rows 2:off` gives each rank its own, for comparison).

`--workload fullft`: Qwen2.5-7B's shape (transformers, random init on each GPU, bf16, sequence 2048, batch 1
per rank), every parameter trained: `offload(vram_budget=...)`, `compile_blocks`, DDP for the resident
parameters, `stagehand.optim.HostAdamW` (fp32 master and moments). On several ranks each block's gradients are
summed into its owner, which alone keeps its optimizer states and steps it on the host (runtime/train/shards.py).
`--deepspeed N` adds DeepSpeed ZeRO-2 with `offload_optimizer: cpu` on N GPUs (the same model, DeepSpeed's
CPU Adam), in the same run.

Per row: samples/s (the ranks' samples over the median step, every rank's step ended by DDP's all-reduce),
the ratio to one GPU, the node's host memory (the sum of the ranks' Pss, read from /proc/<pid>/smaps_rollup:
a page mapped by several ranks counts once), its largest rank's RSS, the page-locked bytes (each rank's
cudaHostRegister'ed ranges; shared pages are the same physical memory), the streamed H2D bytes per step, and
the H2D bound: those bytes over the bandwidth the ranks measured copying at once (NodeStore.seal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def smaps_rollup() -> dict[str, int]:
    """This process's Rss and Pss in bytes (the kernel's /proc/self/smaps_rollup)."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key.lower()] = int(rest.split()[0]) * 1024
    return out


def build(args, device: str, rank: int):
    """The workload's model (LoRA on Flux, or Qwen-7B with every weight training), this rank's inputs, its loss."""
    import torch
    from models import build_flux, build_qwen, flux_config, flux_inputs, loss_of, qwen_inputs, set_checkpointing

    torch.manual_seed(0)
    if args.workload == "lora":
        import peft

        model, _, _ = build_flux(args.tiny, device)
        model.requires_grad_(False)
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16,
                                                           target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
        set_checkpointing("flux", model, True)
        torch.manual_seed(100 + rank)  # each rank its own sample
        inputs, _ = flux_inputs(flux_config(args.tiny), args.tiny, device)
        return model, inputs, lambda out: loss_of("flux", out)
    model, _, _ = build_qwen(args.tiny, device)
    model.config.use_cache = False  # a training step keeps no KV cache (one graph for every block)
    model.requires_grad_(True)
    model.train()
    inputs, _ = qwen_inputs(model.config, args.tiny, device)
    ids = torch.randint(0, model.config.vocab_size, inputs["input_ids"].shape,
                        generator=torch.Generator().manual_seed(100 + rank)).to(device)
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


def child_deepspeed(args, out: dict, device: str, rank: int) -> tuple:
    """DeepSpeed ZeRO-2, optimizer states and step on the CPU (its own engine and all-reduce): (step, runtime None)."""
    import deepspeed
    from full_finetune import _deepspeed_config

    deepspeed.init_distributed()
    model, inputs, loss_of = build(args, device, rank)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_deepspeed_config(2))

    def step():
        engine.backward(loss_of(engine(**inputs)))
        engine.step()

    return step, None


def child_stagehand(args, out: dict, device: str, rank: int, local: int) -> tuple:
    """Offload, compile per block, DDP; LoRA with torch's AdamW or every weight with HostAdamW: (step, runtime)."""
    import torch

    import torch_stagehand as stagehand
    from torch_stagehand.optim import HostAdamW

    cuda = device != "cpu"
    model, inputs, loss_of = build(args, device, rank)
    t0 = time.perf_counter()
    config = stagehand.Config(node_shared_store=args.share)
    rt = stagehand.offload(model, device=device, precision="int8" if args.workload == "lora" else "bf16",
                           verbose=rank == 0, config=config, vram_budget=None if args.tiny else f"{args.budget}GiB")
    out["offload_s"] = round(time.perf_counter() - t0, 1)
    stagehand.compile_blocks(model, **({"options": {"inner": "eager"}} if args.tiny else {}))
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5) if args.workload == "lora" else HostAdamW(trained, lr=1e-5)
    rt.attach(optimizer)
    out["optimizer"] = type(optimizer).__name__

    def step():
        loss_of(ddp(**inputs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    out["host_seconds"] = lambda: getattr(optimizer, "host_seconds", 0.0)
    return step, rt


def child(args) -> None:
    """One rank: build, offload, DDP, time the steps; write this rank's JSON."""
    import torch
    import torch.distributed as dist

    from torch_stagehand.runtime.host import node_store

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available() and not args.tiny
    device = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local)
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11's cuDNN SDPA backward faults at Flux's shape
    out: dict = {"rank": rank, "world": world}
    if args.engine == "deepspeed":
        step, rt = child_deepspeed(args, out, device, rank)
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
        step, rt = child_stagehand(args, out, device, rank, local)
    host_seconds = out.pop("host_seconds", lambda: 0.0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    t0 = time.perf_counter()
    step()
    sync()
    out["first_step_s"] = round(time.perf_counter() - t0, 1)
    for _ in range(args.warmup):  # the calibrating plan, then the plan made from it (and its units)
        step()
    sync()
    dist.barrier()
    before, host0 = rt.stats() if rt else None, host_seconds()
    d2h0 = rt.grads.d2h_bytes if rt else 0
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if rank == 0:
            print(f"  {world} rank(s): step {i + 1}/{args.steps} {times[-1]:.0f} ms", flush=True)
    dist.barrier()  # every rank is at its steady state when the maps are read
    out.update(steps_ms=[round(t, 1) for t in times], step_ms=round(statistics.median(times), 1),
               shared_mapped=node_store.mapped_bytes(), **smaps_rollup(),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
               host_optimizer_ms=round((host_seconds() - host0) / args.steps * 1e3, 1))
    if rt is not None:
        after = rt.stats()
        host = after["host"]
        out.update(
            h2d_gb_step=round((after["h2d_bytes"] - before["h2d_bytes"]) / args.steps / 1e9, 3),
            d2h_gb_step=round((rt.grads.d2h_bytes - d2h0) / args.steps / 1e9, 3),  # this rank's gradients home
            sync_fetches_step=(after["sync_fetches"] - before["sync_fetches"]) / args.steps,
            h2d_gbps=round(rt.plan_driver.cost_model.h2d_bps / 1e9, 1),
            h2d_source=rt.plan_driver.cost_model.measured.get("h2d"),
            pinned_locked_gb=round(host["pinned_locked_bytes"] / 1e9, 2),
            host_store_gb=round(rt.store.host_bytes() / 1e9, 2), node_ranks=host["node_ranks"],
            node_shared_gb=round(host["node_shared_bytes"] / 1e9, 2))
    dist.barrier()
    with open(os.path.join(args.child_out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def run_row(args, gpus: int, share: str = "auto", engine: str = "stagehand") -> dict:
    """One torchrun job of `gpus` ranks; the ranks' JSON folded into the row."""
    port = 29400 + gpus + (7 if share == "off" else 0) + (20 if engine == "deepspeed" else 0)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}", "--master_port", str(port),
               os.path.abspath(__file__), "--child", "--child-out", tmp, "--workload", args.workload,
               "--engine", engine, "--budget", str(args.budget), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--share", share] + (["--tiny"] if args.tiny else [])
        # torchrun would set OMP_NUM_THREADS=1 in each rank: the host's work (HostAdamW, DeepSpeed's CPU Adam)
        # then runs on one core. Every engine gets its share of the cores, as its user would set.
        threads = max(1, len(os.sched_getaffinity(0)) // gpus)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, timeout=args.row_timeout_s * (1.5 if engine == "deepspeed" else 1),
                                  env=env).returncode
        except subprocess.TimeoutExpired:
            done = "timeout"
        wall = time.perf_counter() - t0
        ranks = []
        for r in range(gpus):
            path = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
    label = ("DeepSpeed ZeRO-2 offload_optimizer cpu, " if engine == "deepspeed" else "stagehand, ") + \
        f"{gpus} GPU{'s' * (gpus > 1)}" + (" (a store per rank)" if share == "off" else "")
    if done != 0 or len(ranks) != gpus:
        return {"mode": label, "gpus": gpus, "engine": engine, "error": f"torchrun {done}, {len(ranks)} of {gpus} ranks"}
    step_ms = max(r["step_ms"] for r in ranks)  # DDP's all-reduce ends every rank's step together
    row = {"mode": label, "gpus": gpus, "engine": engine, "share": share, "step_ms": step_ms,
           "omp_num_threads": env["OMP_NUM_THREADS"],
           "samples_s": round(gpus / step_ms * 1e3, 3), "node_pss_gb": round(sum(r["pss"] for r in ranks) / 1e9, 2),
           "max_rank_rss_gb": round(max(r["rss"] for r in ranks) / 1e9, 2),
           "first_step_s": max(r["first_step_s"] for r in ranks), "peak_gib": max((r["peak_gib"] or 0) for r in ranks),
           "host_optimizer_ms": max(r["host_optimizer_ms"] for r in ranks), "wall_s": round(wall, 1), "ranks": ranks}
    if engine == "stagehand":
        lead = ranks[0]
        h2d_ms = lead["h2d_gb_step"] / lead["h2d_gbps"] * 1e3 if lead["h2d_gbps"] else None
        row.update(h2d_gb_step=lead["h2d_gb_step"], d2h_gb_step_per_rank=max(r["d2h_gb_step"] for r in ranks),
                   h2d_gbps_concurrent=lead["h2d_gbps"], h2d_source=lead["h2d_source"],
                   h2d_bound_ms=round(h2d_ms, 1) if h2d_ms else None, host_store_gb=lead["host_store_gb"],
                   node_shared_gb=lead["node_shared_gb"], pinned_locked_gb_per_rank=lead["pinned_locked_gb"],
                   offload_s=max(r["offload_s"] for r in ranks),
                   sync_fetches_step=max(r["sync_fetches_step"] for r in ranks))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["lora", "fullft"], default="lora")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", nargs="*", default=[], help="extra rows GPUS:off (a host store per rank)")
    parser.add_argument("--deepspeed", type=int, nargs="*", default=[], help="DeepSpeed ZeRO-2 rows on these GPUs")
    parser.add_argument("--budget", type=float, default=16.0, help="GiB of GPU memory per rank")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--share", default="auto")
    parser.add_argument("--engine", default="stagehand", choices=["stagehand", "deepspeed"])
    parser.add_argument("--row-timeout-s", type=float, default=560)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "multi_gpu_flux.json"))
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--child-out")
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    from _common import env_info, print_header, print_table, write_json

    env = print_header(env_info())
    rows = [run_row(args, g) for g in args.gpus]
    rows += [run_row(args, int(r.split(":")[0]), "off") for r in args.rows]
    rows += [run_row(args, g, engine="deepspeed") for g in args.deepspeed]
    for r in rows:
        # each system against its own one-GPU row: a ratio to another system's is no scaling figure
        one = next((o for o in rows if o.get("gpus") == 1 and o["engine"] == r["engine"] and "error" not in o), None)
        if one is not None and "error" not in r:
            r["speedup"] = round(r["samples_s"] / one["samples_s"], 3)
            r["node_memory_vs_one"] = round(r["node_pss_gb"] / one["node_pss_gb"], 3)
        peer = next((p for p in rows if p["engine"] == "deepspeed" and p["gpus"] == r["gpus"] and "error" not in p), None)
        if peer is not None and r["engine"] == "stagehand" and "error" not in r:
            r["x_deepspeed"] = round(r["step_ms"] / peer["step_ms"], 3)
    cols = ["mode", "step_ms", "samples_s", "speedup", "x_deepspeed", "h2d_bound_ms", "host_optimizer_ms",
            "node_pss_gb", "node_memory_vs_one", "max_rank_rss_gb", "pinned_locked_gb_per_rank", "offload_s",
            "first_step_s", "error"]
    what = ("Flux-dev LoRA int8" if args.workload == "lora" else "Qwen2.5-7B full fine-tune") + \
        f", {args.budget:g} GiB per GPU, DDP (NCCL)"
    print_table([{c: r.get(c) for c in cols} for r in rows], title="tiny" if args.tiny else what)
    write_json(args.out, {"env": env, "workload": args.workload, "budget_gib": args.budget, "tiny": args.tiny,
                          "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
