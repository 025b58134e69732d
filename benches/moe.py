"""A mixture-of-experts LoRA step at full size: the Qwen3-30B-A3B shape with its experts streamed.

    python benches/moe.py --out benches/results/moe_qwen3_30b.json
    python benches/moe.py --tiny --device cpu          # a smoke test of the bench itself

transformers' `Qwen3MoeForCausalLM` at Qwen3-30B-A3B's shape (48 layers, 128 experts of 768 rows, top-8,
hidden 2048, 30.5B parameters, 61 GB in bf16), random init on the GPU in bf16, base frozen, peft LoRA r=16 on
the attention projections, AdamW on the adapters, the model's own gradient checkpointing on, one sequence of
2048 tokens (16,384 routed token-expert pairs per layer: every expert is hit, so each block streams whole).

Rows, all measured on the one model in this process:

1. "resident (inductor)": the plain model on the GPU, each decoder layer compiled with torch.compile's
   defaults (regional compilation); the compute limit of the step, where the model fits the GPU;
2. `offload()` then `stagehand.compile_blocks(model)`, `--warmup` steps (the plan's calibration step and the
   planned plan's compiles); then for each precision (int8, bf16) and VRAM budget (24 / 16 / 12 GiB):
   `rt.set_precision`, `rt.replan(vram_budget=...)`, the plan's first step, and `--steps` measured steps.

Per row: median step ms, peak GPU memory, H2D GB per step and the H2D limit (those bytes over the pinned
bandwidth measured at the start), the compute limit (the resident step), and the step over the larger of
the two (`vs_limit`; the issue's target is 1.2 at 24 GiB).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
from _common import PEAK_COLUMNS, RESULTS, Sync, env_info, inductor_settings, print_header, print_rows, resident_row, write_json
from models import cuda_preamble, measure

import torch_stagehand as stagehand

GiB = 2**30
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def moe_config(tiny: bool):
    """Qwen3-30B-A3B's shape, or a small one of the same class."""
    from transformers import Qwen3MoeConfig

    if tiny:
        config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1, use_cache=False)
    else:
        config = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True,
                                max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                                tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def build(tiny: bool, device: str):
    from transformers import Qwen3MoeForCausalLM

    config = moe_config(tiny)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 122 GB in fp32 would not fit the GPU it is built on
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    seq = 64 if tiny else 2048
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    return model, {"input_ids": ids, "labels": ids}, seq


def make_step(fn, inputs, optimizer):
    def step():
        fn(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def grouped_tuning() -> dict:
    """The autotuner's pick per grouped-GEMM key (kernels/grouped.py) and every candidate's time, us."""
    from torch_stagehand import kernels

    return {"|".join(map(str, key[:1] + key[2:])): {"chosen": repr(v["chosen"]),
                                                     "times_us": {repr(c): round(t, 1) for c, t in v["times_us"].items()}}
            for key, v in kernels.tuning_log().items() if str(key[0]).startswith("grouped-")}


def run(args) -> dict:
    import peft

    device = args.device
    sync = Sync(device)
    env = print_header(env_info())
    results: dict = {"env": env, "model": "qwen3-30b-a3b shape", "tiny": args.tiny, "rows": [],
                     "inductor": inductor_settings()}
    cuda_preamble(results, device)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, inputs, seq = build(args.tiny, device)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS))
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = sum(p.numel() for p in model.parameters())
    results.update(sequence=seq, build_s=round(time.perf_counter() - t0, 1), params_b=round(params / 1e9, 2))
    print(f"built: {results['params_b']}B parameters in {results['build_s']} s", flush=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    rows = results["rows"]

    def measured(label: str, step) -> dict:
        return measure(label, step, args.steps, sync)

    resident = None
    if args.resident:
        resident = resident_row("inductor", model, lambda fn: make_step(fn, inputs, optimizer), measured,
                                regional=True, limit_s=args.inductor_limit_s)
        rows.append(resident)
        print({k: v for k, v in resident.items() if k != "steps_ms"}, flush=True)
    compute_ms = None if resident is None or "error" in resident else resident["step_ms"]
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    rt = stagehand.offload(model, device=device, precision=args.precisions[0],
                           vram_budget=f"{args.budgets[0]}GiB" if device == "cuda" else None)
    sync()
    results["offload_s"] = round(time.perf_counter() - t0, 1)
    n = len(rt.blocks)
    summary = rt.offload_summary
    results["offload"] = {k: summary.get(k) for k in ("streamed_layers", "expert_stacks", "expert_bytes", "host_bytes")}
    results["streamed_bytes"] = {p: sum(rt.block_nbytes(b, p) for b in range(n)) for p in args.precisions}
    print(f"offload: {n} blocks, {summary['expert_stacks']} expert stacks in {results['offload_s']} s; streamed "
          + ", ".join(f"{p} {b / 1e9:.2f} GB" for p, b in results["streamed_bytes"].items()), flush=True)
    rt.attach(optimizer)
    stagehand.compile_blocks(model)
    step = make_step(model, inputs, optimizer)
    t0 = time.perf_counter()
    for i in range(args.warmup):  # the calibration step and the planned plan's compiles, outside every row
        step()
        sync()
        print(f"  warm-up step {i + 1}/{args.warmup} at {time.perf_counter() - t0:.1f} s", flush=True)
    results["warmup_s"] = round(time.perf_counter() - t0, 1)
    def budget_row(precision: str, budget: int, label: str) -> dict:
        try:
            rt.set_precision(precision)
            if device == "cuda":
                rt.replan(vram_budget=f"{budget}GiB")
            row = measure(label, step, args.steps, sync, rt)
        except torch.OutOfMemoryError:
            row = {"mode": label, "error": "out of GPU memory"}
        row.update(precision=precision, budget_gib=budget)
        if "h2d_gb_step" in row and results.get("pinned_h2d_gbps"):
            # the limit is what the plan must move, not what the run moved (a run that moves more than its plan
            # would look close to a limit it set itself); the measured traffic's time stands beside it
            planned = rt.stats().get("planned_h2d_bytes")
            if planned:
                row["planned_h2d_gb_step"] = round(planned / 1e9, 3)
                row["planned_h2d_limit_ms"] = round(row["planned_h2d_gb_step"] / results["pinned_h2d_gbps"] * 1e3, 1)
            row["h2d_limit_ms"] = round(row["h2d_gb_step"] / results["pinned_h2d_gbps"] * 1e3, 1)
            row["compute_limit_ms"] = compute_ms
            row["limit_ms"] = max(row.get("planned_h2d_limit_ms", row["h2d_limit_ms"]), compute_ms or 0)
            row["vs_limit"] = round(row["step_ms"] / row["limit_ms"], 3) if row["limit_ms"] else None
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("steps_ms", "first_step_parts_s")}, flush=True)
        return row

    for precision in args.precisions:
        for budget in args.budgets:
            budget_row(precision, budget, f"stagehand {precision} {budget} GiB")
    results["grouped_tuning"] = grouped_tuning()
    if args.dense_rows and "int8" in args.precisions:
        # The A/B of the int8 stacks' math: the same blocks compiled with the stacks dequantized in the graph
        # and read by the model's grouped_mm (experts_math="dense"), at the first budget.
        grouped = next(r for r in rows if r.get("precision") == "int8" and r.get("budget_gib") == args.budgets[0])
        torch._dynamo.reset()
        stagehand.compile_blocks(model, options={"recompute": "model", "experts_math": "dense"})
        row = budget_row("int8", args.budgets[0], f"stagehand int8 {args.budgets[0]} GiB, experts dense")
        if "step_ms" in row and "step_ms" in grouped:
            grouped["vs_dense_experts"] = round(grouped["step_ms"] / row["step_ms"], 3)
    results["stats"] = {k: v for k, v in rt.stats().items() if isinstance(v, (int, float, str))}
    return results


COLUMNS = ["mode", "step_ms", "h2d_gb_step", "planned_h2d_gb_step", "planned_h2d_limit_ms", "h2d_limit_ms", "compute_limit_ms", "vs_limit", "vs_dense_experts",
           *PEAK_COLUMNS,
           "sync_fetches_step", "eager_linear_calls", "error"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", nargs="+", default=["int8", "bf16"], choices=["int8", "bf16"])
    parser.add_argument("--budgets", nargs="+", type=int, default=[24, 16, 12], help="VRAM budgets, GiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the rows (calibration, planned compiles)")
    parser.add_argument("--tiny", action="store_true", help="a small config of the same class (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resident", action=argparse.BooleanOptionalAction, default=True,
                        help="the resident model's regional Inductor step (the compute limit)")
    parser.add_argument("--inductor-limit-s", type=float, default=300)
    parser.add_argument("--dense-rows", action="store_true",
                        help="an int8 row at the first budget with the stacks dequantized in the graph (the A/B)")
    parser.add_argument("--out", default=f"{RESULTS}/moe_qwen3_30b.json")
    args = parser.parse_args(argv)
    results = run(args)
    print_rows(results["rows"], COLUMNS, title="Qwen3-30B-A3B shape, LoRA r=16 on attention, T=2048, checkpointing")
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
