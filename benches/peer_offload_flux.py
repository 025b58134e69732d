"""Peers of docs/coming-from.md on the flagship model: diffusers' group offloading and accelerate's cpu_offload,
LoRA-training the same Flux-dev transformer as benches/models.py (11.9B, 4096 image + 512 text tokens, bf16, peft
LoRA r=16 on the attention projections, AdamW, the model's own gradient checkpointing), with the resident model
measured in the same run (the ratio's baseline) and stagehand bf16 / int8 beside them.

    python benches/peer_offload_flux.py                          # on the GPU: every row
    python benches/peer_offload_flux.py --tiny --device cpu      # smoke run: a small config on the CPU

Rows:
- resident: everything on the device.
- diffusers group offload, `enable_group_offload(onload_device, offload_type="block_level",
  num_blocks_per_group=K, use_stream=True)` for each K in --groups (use_stream on CUDA only).
- accelerate `cpu_offload(model, execution_device)`: every parameter through hooks.
- stagehand bf16 and int8 (inner compiler inductor on CUDA, eager on the CPU).
Each row builds a fresh model (the offloaders change it in place). A row whose tool cannot train this set-up
(an error in its hooks, out of memory) is recorded with its error instead of numbers: that is a finding too.
Prints a table (step ms, ratio to resident, peak GiB) and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

import torch
from _common import RESULTS, env_info, host_memory, print_header, print_table, reset_host_peak, write_json
from models import LORA_TARGETS, Sync, build_flux, make_step, measure


def build(args, device_for_weights: str):
    """A fresh Flux with LoRA, its weights on `device_for_weights`; always built on args.device (random init of
    12B parameters takes seconds on a GPU, minutes on the host) and moved, so every row has the same weights."""
    import peft

    torch.manual_seed(0)
    model, inputs, shape = build_flux(args.tiny, args.device)
    model.to(device_for_weights)
    model.requires_grad_(False)
    model.enable_gradient_checkpointing()
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS["flux"]))
    return model, inputs, shape


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def row_resident(args, sync):
    model, inputs, _ = build(args, args.device)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-5)
    row = measure("resident", make_step("flux", model, model, inputs, optimizer), args.steps, sync)
    return dict(row, **host_memory())


def row_group_offload(args, sync, k: int):
    model, inputs, _ = build(args, "cpu")
    base = model.get_base_model()
    t0 = time.perf_counter()
    base.enable_group_offload(torch.device(args.device), offload_type="block_level", num_blocks_per_group=k,
                              use_stream=args.device == "cuda")
    prepare_s = time.perf_counter() - t0
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-5)
    row = measure(f"diffusers group offload, num_blocks_per_group={k}",
                  make_step("flux", model, model, inputs, optimizer), args.steps, sync)
    return dict(row, prepare_s=round(prepare_s, 1), **host_memory())


def row_accelerate(args, sync):
    from accelerate import cpu_offload

    model, inputs, _ = build(args, "cpu")
    t0 = time.perf_counter()
    cpu_offload(model, execution_device=torch.device(args.device))
    prepare_s = time.perf_counter() - t0
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-5)
    row = measure("accelerate cpu_offload", make_step("flux", model, model, inputs, optimizer), args.steps, sync)
    return dict(row, prepare_s=round(prepare_s, 1), **host_memory())


def row_stagehand(args, sync, precision: str):
    import torch_stagehand as stagehand

    model, inputs, _ = build(args, "cpu")
    t0 = time.perf_counter()
    rt = stagehand.offload(model, device=args.device, precision=precision, verbose=False)
    prepare_s = time.perf_counter() - t0
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-5)
    rt.attach(optimizer)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand",
                             options={"inner": "inductor" if args.device == "cuda" else "eager"})
    row = measure(f"stagehand {precision}", make_step("flux", model, compiled, inputs, optimizer), args.steps, sync,
                  rt=rt)
    row.update(host_memory(), stagehand_pinned_gb=round(rt.stats()["host"]["pinned_locked_bytes"] / 1e9, 2))
    rt.close()
    return dict(row, prepare_s=round(prepare_s, 1))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a small Flux config (smoke run)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--groups", type=int, nargs="+", default=[1, 4], help="diffusers num_blocks_per_group values")
    p.add_argument("--rows", nargs="+", default=["resident", "group", "accelerate"],
                   help="resident, group, accelerate, stagehand (stagehand: also in benches/models.py)")
    p.add_argument("--out", default=os.path.join(RESULTS, "peer_offload_flux.json"))
    args = p.parse_args(argv)
    sync = Sync(args.device)
    results = {"env": print_header(env_info()), "tiny": args.tiny, "rows": []}
    if args.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as benches/models.py: cuDNN SDPA backward faults at this shape
    jobs = []
    if "resident" in args.rows:
        jobs.append(("resident", lambda: row_resident(args, sync)))
    if "group" in args.rows:
        jobs += [(f"group {k}", lambda k=k: row_group_offload(args, sync, k)) for k in args.groups]
    if "accelerate" in args.rows:
        jobs.append(("accelerate", lambda: row_accelerate(args, sync)))
    if "stagehand" in args.rows:
        jobs += [(f"stagehand {p}", lambda p=p: row_stagehand(args, sync, p)) for p in ("bf16", "int8")]
    baseline = None
    for name, job in jobs:
        print(f"== {name}", flush=True)
        reset_host_peak()
        try:
            row = job()
        except Exception as e:  # noqa: BLE001 - a peer that cannot train this set-up is a result
            traceback.print_exc()
            row = {"mode": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        if name == "resident" and "error" not in row:
            baseline = row
        if baseline is not None and row.get("step_ms"):
            row["ratio"] = round(row["step_ms"] / baseline["step_ms"], 3)
        results["rows"].append(row)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    table = [[r["mode"], r.get("step_ms"), r.get("ratio"), r.get("peak_gib"), r.get("rss_gb"), r.get("torch_pinned_gb"),
              r.get("prepare_s"), r.get("first_step_s"), r.get("error", "")] for r in results["rows"]]
    print_table(table, headers=["mode", "step ms", "x resident", "peak GiB", "host RSS GB", "torch pinned GB",
                                "prepare s", "first step s", "error"],
                title=f"Flux LoRA training step, {results['env']['device']}")
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
