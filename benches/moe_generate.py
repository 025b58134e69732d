"""Generation with a mixture-of-experts model larger than the GPU's budget: stagehand against accelerate's offload.

    python benches/moe_generate.py --out benches/results/moe_generate.json
    python benches/moe_generate.py --tiny --device cpu          # a smoke test of the bench itself

The Qwen3-30B-A3B shape (benches/moe.py, 61 GB in bf16), random init on the GPU, batch 1, a prompt of
`--prompt` tokens, greedy `model.generate` with its KV cache, in one process:

1. stagehand: `offload(model, precision=..., vram_budget=...)` and `generate` as it is (no compile: a
   KV cache indexed by layer would trace every block): each new token reads its layers and only the experts
   its router picked (`Config.routed_experts_max_tokens`, the default), through the expert cache with the
   next block's experts prefetched from its router's guess (runtime/experts/cache.py; "auto" size, or the
   cache at its floor), or, for comparison, streams every block whole (`routed_experts_max_tokens=0`);
2. accelerate: the same model back on the host (`rt.restore()`), `infer_auto_device_map` with the same
   GPU budget and `dispatch_model` (layers that do not fit run from host memory through its hooks).

Per row: new tokens a second (the prefill and the first token apart), peak GPU memory, and for stagehand
the H2D GB per token against the pinned bandwidth measured at the start (the PCIe limit).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
from _common import RESULTS, Sync, env_info, print_header, print_rows, write_json
from moe import build
from models import pinned_h2d_gbps

import torch_stagehand as stagehand


FETCH_LABELS = {"routed": "routed experts, expert cache", "routed-floor": "routed experts, cache at its floor",
                "whole": "whole blocks"}


def generate_row(label: str, model, prompt: torch.Tensor, new_tokens: int, sync: Sync, rt=None,
                 warmup: int = 0) -> tuple[dict, torch.Tensor]:
    """One greedy generation, each new token's time taken as it is made (a stopping criterion that syncs and
    reads the clock); tokens a second over the tokens after the first (the first is the prefill). `warmup`:
    new tokens of a generation run first (its experts stay in the expert cache, as a chat's earlier turns)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            sync()
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    if warmup:  # the W8A16 autotuner's first calls at the prompt's and a token's shapes, outside the timing
        sync.reset_peak()  # the memory the model was built with is not this row's (the expert cache sizes from it)
        model.generate(prompt, max_new_tokens=warmup, min_new_tokens=warmup, do_sample=False, use_cache=True,
                       pad_token_id=0)
    sync.reset_peak()
    h2d = rt.stats()["h2d_bytes"] if rt is not None else 0
    t0 = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         use_cache=True, pad_token_id=0, stopping_criteria=StoppingCriteriaList([Clock()]))
    sync()
    decode = stamps[-1] - stamps[0]
    row = {"mode": label, "new_tokens": len(stamps), "first_token_s": round(stamps[0] - t0, 2),
           "token_ms": [round((b - a) * 1e3, 1) for a, b in zip(stamps, stamps[1:])],
           "tokens_per_s": round((len(stamps) - 1) / decode, 3) if decode > 0 else None, **sync.peaks()}
    if rt is not None:
        row["h2d_gb_token"] = round((rt.stats()["h2d_bytes"] - h2d) / len(stamps) / 1e9, 2)
    print(row, flush=True)
    return row, out


def run(args) -> dict:
    device = args.device
    sync = Sync(device)
    env = print_header(env_info())
    results: dict = {"env": env, "model": "qwen3-30b-a3b shape", "tiny": args.tiny, "rows": [],
                     "prompt_tokens": args.prompt, "budget": args.budget}
    if device == "cuda":
        results["pinned_h2d_gbps"] = round(pinned_h2d_gbps(), 1)
    torch.manual_seed(0)
    model, _inputs, _seq = build(args.tiny, device)
    model.requires_grad_(False)
    model.eval()
    model.config.use_cache = True
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(device)
    rows = results["rows"]
    with torch.no_grad():
        for precision in args.precisions:
            for fetch in args.fetch:
                config = stagehand.Config(routed_experts_max_tokens=0 if fetch == "whole" else 16,
                                          expert_cache_bytes=0 if fetch == "routed-floor" else "auto")
                rt = stagehand.offload(model, device=device, precision=precision, config=config,
                                       vram_budget=args.budget if device == "cuda" else None, verbose=False)
                what = FETCH_LABELS[fetch]
                row, _ = generate_row(f"stagehand {precision}, {what}", model, prompt, args.tokens, sync, rt,
                                      warmup=args.warmup_tokens)
                reads = rt.stats()["routed_reads"]
                row["expert_cache"] = reads["expert_cache"]
                row["cache_hit_rate"] = (round(reads["expert_cache"]["hits"] / max(
                    reads["expert_cache"]["hits"] + reads["expert_cache"]["misses"], 1), 3) if fetch != "whole" else None)
                row["whole_stacks"] = reads["whole_stacks"]
                if results.get("pinned_h2d_gbps"):
                    row["h2d_limit_tokens_per_s"] = round(results["pinned_h2d_gbps"] / max(row["h2d_gb_token"], 1e-9), 3)
                    row["vs_h2d_limit"] = round(row["h2d_limit_tokens_per_s"] / row["tokens_per_s"], 2)
                rows.append(row)
                rt.restore()
                del rt
                gc.collect()
        if args.accelerate:
            from accelerate import dispatch_model, infer_auto_device_map

            model.to("cpu")
            if device == "cuda":
                torch.cuda.empty_cache()
            device_map = infer_auto_device_map(model, max_memory={0: args.budget, "cpu": "1000GiB"} if device == "cuda"
                                               else {"cpu": "1000GiB"},
                                               no_split_module_classes=["Qwen3MoeDecoderLayer"])
            results["accelerate_device_map"] = {str(k): str(v) for k, v in device_map.items()}
            dispatch_model(model, device_map=device_map)
            row, _ = generate_row("accelerate device_map='auto' (dispatch_model)", model, prompt,
                                                      args.accelerate_tokens, sync)
            rows.append(row)
    base = next((r for r in rows if r["mode"].startswith("accelerate")), None)
    for r in rows:
        if base is not None and r is not base:
            r["x_accelerate"] = (round(r["tokens_per_s"] / base["tokens_per_s"], 2)
                                 if r.get("tokens_per_s") and base.get("tokens_per_s") else None)
    # No comparison of the tokens: random weights give near-uniform logits, whose greedy picks flip between
    # any two sets of kernels (the numbers are checked against the plain model by tests/runtime/experts/test_moe.py).
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", nargs="+", default=["int8", "bf16"], choices=["int8", "bf16"])
    parser.add_argument("--budget", default="8GiB")
    parser.add_argument("--fetch", nargs="+", default=["routed", "routed-floor", "whole"], choices=list(FETCH_LABELS),
                        help="expert fetching: the routed experts only with the expert cache (the default config), "
                             "with the cache at its floor (expert_cache.FLOOR_TOKENS tokens' picks, twice), or whole blocks")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per stagehand row")
    parser.add_argument("--accelerate-tokens", type=int, default=8, help="new tokens for accelerate's row")
    parser.add_argument("--warmup-tokens", type=int, default=2,
                        help="a short generation before each stagehand row (the autotuner's first calls)")
    parser.add_argument("--accelerate", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=f"{RESULTS}/moe_generate.json")
    args = parser.parse_args(argv)
    results = run(args)
    print_rows(results["rows"], ["mode", "new_tokens", "first_token_s", "tokens_per_s", "x_accelerate",
                                 "h2d_gb_token", "h2d_limit_tokens_per_s", "cache_hit_rate", "peak_gib"],
               title=f"Qwen3-30B-A3B shape, batch 1, greedy generation, GPU budget {args.budget}")
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
