"""Workload A with FP8 allowed (issue 10): 48 blocks of 3072 at 4096 tokens, LoRA, against resident BF16.

    python benches/fp8_workload.py --out benches/results/fp8_workload_a.json       # an FP8 GPU (Hopper, Ada)
    python benches/fp8_workload.py --tiny --device cpu                              # a smoke test of the bench

The model: diffusers `FluxTransformer2DModel` with 48 single-stream blocks of
3072 (Flux's single block: to_q / to_k / to_v, a 12288-wide MLP in, a
15360 -> 3072 projection out) and no double-stream blocks, 3584 image + 512
text tokens = 4096 tokens through every block; random init on the GPU, bf16,
base frozen, peft LoRA r=16 on to_q / to_k / to_v, AdamW. In this one process:

1. the FP8 policy file for this GPU (`fp8_bench`: every Linear shape of the
   block at 4096 tokens, fp8 forward + grad-input against cuBLAS bf16, speedup
   threshold 1.0): where FP8 is allowed at all;
2. "resident bf16 (inductor)": the resident model under `torch.compile`
   with its default backend and options, the baseline (`ratio_inductor`);
   with `--resident-eager` also "resident bf16 (eager)" (`ratio_eager`);
3. stagehand fp8 with no budget: every block streamed through two slots;
4. stagehand fp8 with a VRAM budget the whole model fits in (the plan keeps
   every block resident, in fp8); with `--fp8-mlp-row` also the per-layer map
   "fp8-mlp" (MLP in fp8, attention projections in bf16);
5. stagehand bf16 with the same budget: the same program with bf16 weights,
   which separates what fp8 gains from what stagehand itself costs.

Per row: step time (median of `--steps` after warm-up), host time, peak GPU
memory allocated and reserved (timed steps; and the first step alone), H2D
GB per step, plan counts, ratio to each resident baseline (`ratio` is the
old field, = ratio_inductor).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
from _common import (PEAK_COLUMNS, RATIO_COLUMNS, RATIOS_NOTE, RESULTS, Sync, add_ratios, env_info, inductor_settings,
                     print_header, print_rows, print_table, resident_label, resident_row, write_json)
from budget_sweep import gpu_lanes, plan_columns, timed
from torch_stagehand.runtime.atomic_file import write_atomic
from models import flux_config, flux_inputs, make_step

import torch_stagehand as stagehand

GiB = 2**30
LORA_TARGETS = ["to_q", "to_k", "to_v"]


def build(tiny: bool, device: str):
    from diffusers import FluxTransformer2DModel

    cfg = flux_config(tiny)
    cfg.update(num_layers=0, num_single_layers=4 if tiny else 48)
    with torch.device(device):
        model = FluxTransformer2DModel(**cfg).to(torch.bfloat16)
    inputs, _ = flux_inputs(cfg, tiny, device)
    img, txt = (24, 8) if tiny else (3584, 512)
    inputs["hidden_states"] = inputs["hidden_states"][:, :img]
    inputs["img_ids"] = inputs["img_ids"][:img]
    return model, inputs, {"blocks": cfg["num_single_layers"], "image_tokens": img, "text_tokens": txt,
                           "tokens_per_block": img + txt}


def fp8_policy(tokens: int, path: str) -> dict:
    """Measure the block's Linear shapes at this token count; write the policy file; the measured rows."""
    from torch_stagehand.runtime.selective import fp8_bench, fp8_rules

    shapes = [(3072, 3072), (12288, 3072), (3072, 15360)]  # (out, in): q/k/v, proj_mlp, proj_out
    rows = fp8_bench.measure(shapes, [tokens])
    policy = fp8_rules.Fp8Policy(torch.cuda.get_device_name(), 1.0, fp8_rules.rules_from_measurements(rows, 1.0))
    fp8_rules.save(policy, path)
    return {"rows": rows, "file": os.path.basename(path), "rules": len(policy.rules)}


def write_profile(step, path: str) -> None:
    """One step under torch.profiler: the ops by host (self CPU) time and the kernels by GPU time, as text."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    write_atomic(path, averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70) + "\n\n"
                 + averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
    print(f"wrote {path}", flush=True)


def run(args) -> dict:
    import peft

    device, sync = args.device, Sync(args.device)
    results: dict = {"env": print_header(env_info()), "tiny": args.tiny, "rows": []}
    rows = results["rows"]
    cuda = device == "cuda"
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11's cuDNN SDPA backward faults at Flux's shape
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, inputs, shape = build(args.tiny, device)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    results.update(shape=shape, build_s=round(time.perf_counter() - t0, 1),
                   params_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 2))
    print(f"built: {results['params_b']}B parameters, {shape}, {results['build_s']} s", flush=True)

    if cuda and not args.tiny:
        results["fp8_policy"] = fp8_policy(shape["tokens_per_block"], os.path.join(os.path.dirname(args.out),
                                                                                    "fp8_policy_workload_a.json"))
        print_table(results["fp8_policy"]["rows"], title="fp8 vs bf16 per Linear shape (forward + grad-input)")

    def step_of(fn):
        return make_step("flux", model, fn, inputs, optimizer)

    baselines: dict[str, dict] = {}
    results["ratios"] = dict(RATIOS_NOTE, ratio="old field, kept for readers of earlier files: the same as "
                                               "ratio_inductor (this bench's baseline was always the compiled one)")
    results["inductor"] = inductor_settings()

    def add(row: dict) -> None:
        add_ratios(row, baselines)
        if row.get("ratio_inductor") is not None:
            row["ratio"] = row["ratio_inductor"]
        rows.append(row)
        write_json(args.out, results)  # after every row: a run cut off by a time limit keeps what it measured

    def profile_resident(label: str, step) -> None:
        if args.profile and cuda:
            name = label.replace(" (inductor)", "").replace(" (", "_").replace(")", "").replace(" ", "_")
            write_profile(step, f"{os.path.dirname(args.out)}/profile_{name}.txt")

    # the resident bf16 model: under torch.compile's defaults (the baseline), and eagerly with --resident-eager
    for compiler in ("inductor", "eager") if args.resident_eager else ("inductor",):
        baselines[compiler] = resident_row(compiler, model, step_of,
                                           lambda label, step: timed(label, step, args.steps, sync, warmup=2),
                                           resident_label(compiler, "resident bf16"), args.inductor_limit_s,
                                           also=profile_resident)
        add(baselines[compiler])
    for row in baselines.values():
        add_ratios(row, baselines)
    if cuda:
        torch.cuda.empty_cache()

    precision = "fp8" if cuda else "bf16"  # the CPU has no FP8 tensor cores: the smoke run checks the stages
    budget = "70GiB" if cuda else int(1e9)
    t0 = time.perf_counter()
    rt = stagehand.offload(model, device=device, precision=precision)
    results["offload_s"] = round(time.perf_counter() - t0, 1)
    rt.attach(optimizer)
    compiled = torch.compile(model, backend="stagehand")
    step = step_of(compiled)

    def measured(label: str, warmup: int, step=step) -> None:
        try:
            row = dict(timed(label, step, args.steps, sync, rt, warmup=warmup), **plan_columns(rt))
            if args.profile and cuda:
                row["lanes"] = gpu_lanes(step)
                write_profile(step, f"{os.path.dirname(args.out)}/profile_{label.split(',')[0].replace(' ', '_')}.txt")
            add(row)
        except torch.OutOfMemoryError:
            add({"mode": label, "error": "out of GPU memory"})

    if not args.skip_two_slot:
        measured(f"stagehand {precision}, no budget (two slots)", warmup=2)
    rt.replan(vram_budget=budget)  # calibration steps (the smallest plan), then the plan the budget allows
    measured(f"stagehand {precision}, budget {budget}", warmup=5)
    if args.gc_off_row:  # the same plan with Python's collector off while timed: what gc costs the host
        gc.collect()
        gc.disable()
        try:
            measured(f"stagehand {precision}, budget {budget}, gc off", warmup=1)
        finally:
            gc.enable()
    if cuda and args.op_path_row:
        # The same plan with every fp8 Linear as the opaque stagehand::linear op (its quantization and GEMM
        # launched from Python per call) instead of traced into the block's graph: what the tracing buys.
        torch._dynamo.reset()
        op_step = step_of(torch.compile(model, backend="stagehand", options={"linear_math": "op"}))
        measured(f"stagehand {precision}, budget {budget}, fp8 as the op", warmup=3, step=op_step)
        del op_step
        torch._dynamo.reset()
        step = step_of(torch.compile(model, backend="stagehand"))
    if cuda and args.fp8_mlp_row:
        # FP8 where the policy file measured it faster (the MLP's 12288- and 15360-wide GEMMs), bf16 for the
        # attention projections (3072 x 3072: measured slower, host-bound): the per-layer map "fp8-mlp".
        rt.set_precision("fp8-mlp")
        measured("stagehand fp8-mlp (attention bf16), budget " + str(budget), warmup=3, step=step)
    if not args.skip_bf16_budget:
        rt.set_precision("bf16")  # same budget, the plan re-made for bf16 bytes
        measured(f"stagehand bf16, budget {budget}", warmup=2, step=step)
    results["stats"] = rt.stats()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a small config of the same class (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-two-slot", action="store_true", help="no row for the fixed two-slot plan")
    parser.add_argument("--skip-bf16-budget", action="store_true", help="no row for bf16 under the budget")
    parser.add_argument("--fp8-mlp-row", action="store_true", help="a row with the MLP in fp8, attention bf16")
    parser.add_argument("--op-path-row", action="store_true",
                        help="a row with fp8 Linears as the stagehand::linear op, not traced into the graph")
    parser.add_argument("--gc-off-row", action="store_true", help="a row with Python's gc off while timed")
    parser.add_argument("--profile", action="store_true", help="per stagehand row: GPU lanes and a profile table")
    parser.add_argument("--resident-eager", action="store_true",
                        help="also the resident bf16 model run eagerly (ratio_eager; the compiled one stays first)")
    parser.add_argument("--inductor-limit-s", type=float, default=0,
                        help="stop the resident Inductor row after this many seconds, compile included (0: no limit)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "fp8_workload_a.json"))
    args = parser.parse_args(argv)
    results = run(args)
    cols = ["mode", "step_ms", "host_ms", *RATIO_COLUMNS, *PEAK_COLUMNS, "h2d_gb_step", "resident", "streamed",
            "predicted_ms", "compile_s", "error"]
    print_rows(results["rows"], cols,
               title=f"workload A: {results['params_b']}B parameters, {results['shape']}, {results['env']['device']};"
                     f" baselines: resident bf16 (inductor) = torch.compile's defaults, (eager) = run eagerly")
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
