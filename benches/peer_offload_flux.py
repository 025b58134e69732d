"""Peers of docs/coming-from.md on the flagship model: diffusers' group offloading and accelerate's cpu_offload,
LoRA-training the same Flux-dev transformer as benches/models.py (11.9B, 4096 image + 512 text tokens, bf16, peft
LoRA r=16 on the attention projections, AdamW, the model's own gradient checkpointing), with the resident model
measured in the same run, eagerly and under torch.compile's defaults (the baselines: `ratio_inductor`, to the
compiled one, first; `ratio_eager`; `ratio` is the old field, = ratio_eager), and stagehand bf16 / int8 beside them.

    python benches/peer_offload_flux.py                          # on the GPU: every row
    python benches/peer_offload_flux.py --tiny --device cpu      # smoke run: a small config on the CPU

Rows:
- resident (eager) and resident (inductor): everything on the device; the inductor row runs last (its first step
  compiles the whole model, ~6 min at 12B on an H100), `--resident-compilers eager` leaves it out.
- diffusers group offload, `enable_group_offload(onload_device, offload_type="block_level",
  num_blocks_per_group=K, use_stream=True)` for each K in --groups (use_stream on CUDA only), eager and with
  `compile_repeated_blocks()` (--group-compile).
- accelerate `cpu_offload(model, execution_device)`: every parameter through hooks.
- stagehand bf16 and int8 (inner compiler inductor on CUDA, eager on the CPU).
Each row builds a fresh model (the offloaders change it in place). A row whose tool cannot train this set-up
(an error in its hooks, out of memory) is recorded with its error instead of numbers: that is a finding too.
Prints a table (step ms, ratio to each resident baseline, peak GiB allocated and reserved over the timed steps and
the first step alone) and writes JSON (--out) after every row.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

import torch
from _common import (PEAK_COLUMNS, RATIO_COLUMNS, RATIOS_NOTE, RESULTS, Sync, add_ratios, env_info, host_memory,
                     inductor_settings, print_header, print_rows, reset_host_peak, resident_row, write_json)
from models import LORA_TARGETS, build_flux, make_step, measure


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


def row_resident(args, sync, compiler: str):
    """The resident baseline: every weight on the device, run eagerly or under torch.compile's defaults."""
    model, inputs, _ = build(args, args.device)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-5)
    row = resident_row(compiler, model, lambda fn: make_step("flux", model, fn, inputs, optimizer),
                       lambda label, step: measure(label, step, args.steps, sync), limit_s=args.inductor_limit_s)
    return dict(row, **host_memory())


def row_group_offload(args, sync, k: int, compiled: str):
    """diffusers' block-level group offloading; `compiled` "regional" compiles each repeated block with
    `compile_repeated_blocks()` after the offload hooks are on (diffusers made the two compose in PR 11605), as the
    resident (inductor, regional) baseline of benches/budget_sweep.py is compiled."""
    model, inputs, _ = build(args, "cpu")
    base = model.get_base_model()
    t0 = time.perf_counter()
    base.enable_group_offload(torch.device(args.device), offload_type="block_level", num_blocks_per_group=k,
                              use_stream=args.device == "cuda")
    prepare_s = time.perf_counter() - t0
    limit = torch._dynamo.config.recompile_limit
    if compiled == "regional":
        torch._dynamo.reset()
        # as diffusers' own group-offload + compile benchmark (PR 11605): its hooks guard on each block's name,
        # so every block is a recompile of the same code, past Dynamo's default limit of 8
        torch._dynamo.config.recompile_limit = 10000
        base.compile_repeated_blocks()
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-5)
    try:
        row = measure(f"diffusers group offload, num_blocks_per_group={k}, use_stream, {compiled}",
                      make_step("flux", model, model, inputs, optimizer), args.steps, sync)
    finally:
        torch._dynamo.config.recompile_limit = limit
    return dict(row, prepare_s=round(prepare_s, 1), compiled=compiled, **host_memory(),
                **({"recompile_limit": 10000} if compiled == "regional" else {}))


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
    p.add_argument("--group-compile", nargs="+", choices=["none", "regional"], default=["none", "regional"],
                   help="the group-offload rows eager (none) and with compile_repeated_blocks() (regional)")
    p.add_argument("--rows", nargs="+", default=["resident", "group", "accelerate"],
                   help="resident, group, accelerate, stagehand (stagehand: also in benches/models.py)")
    p.add_argument("--resident-compilers", nargs="+", choices=["eager", "inductor"], default=["eager", "inductor"],
                   help="the resident baselines: eager, and torch.compile's default backend (Inductor) and options")
    p.add_argument("--inductor-limit-s", type=float, default=0,
                   help="stop the resident Inductor row after this many seconds, compile included (0: no limit)")
    p.add_argument("--out", default=os.path.join(RESULTS, "peer_offload_flux.json"))
    args = p.parse_args(argv)
    sync = Sync(args.device)
    results = {"env": print_header(env_info()), "tiny": args.tiny, "rows": [], "inductor": inductor_settings(),
               "ratios": RATIOS_NOTE}
    if args.device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as benches/models.py: cuDNN SDPA backward faults at this shape
    resident = [c for c in args.resident_compilers if "resident" in args.rows]
    jobs = []
    if "eager" in resident:
        jobs.append(("resident (eager)", lambda: row_resident(args, sync, "eager")))
    if "group" in args.rows:
        jobs += [(f"group {k} {c}", lambda k=k, c=c: row_group_offload(args, sync, k, c))
                 for k in args.groups for c in args.group_compile]
    if "accelerate" in args.rows:
        jobs.append(("accelerate", lambda: row_accelerate(args, sync)))
    if "stagehand" in args.rows:
        jobs += [(f"stagehand {p}", lambda p=p: row_stagehand(args, sync, p)) for p in ("bf16", "int8")]
    if "inductor" in resident:  # last: its first step compiles the whole model (minutes at 12B); a run cut off
        jobs.append(("resident (inductor)", lambda: row_resident(args, sync, "inductor")))  # keeps the rest
    baselines: dict[str, dict] = {}
    for name, job in jobs:
        print(f"== {name}", flush=True)
        reset_host_peak()
        try:
            row = job()
        except Exception as e:  # noqa: BLE001 - a peer that cannot train this set-up is a result
            traceback.print_exc()
            row = {"mode": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        if row.get("baseline") and "error" not in row:
            baselines[row["baseline"]] = row
        results["rows"].append(row)
        for r in results["rows"]:  # every row against the baselines measured so far
            add_ratios(r, baselines)
            if r.get("ratio_eager") is not None:
                r["ratio"] = r["ratio_eager"]  # the field's old meaning (before ratio_inductor existed)
        write_json(args.out, results)  # after every row: a run cut off by a time limit keeps what it measured
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    table = sorted(results["rows"], key=lambda r: "baseline" not in r)  # the baselines first
    print_rows(table, ["mode", "step_ms", *RATIO_COLUMNS, *PEAK_COLUMNS, "rss_gb", "torch_pinned_gb", "prepare_s",
                       "compile_s", "error"],
               title=f"Flux LoRA training step, {results['env']['device']}; baselines: resident (inductor) = "
                     f"torch.compile's defaults, resident (eager) = run eagerly; every weight on the device")
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
