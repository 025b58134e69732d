"""Convergence at fewer bytes (issue 10): all-bf16 vs all-int8 vs dynamic selective vs dynamic + fp8.

A byte-level LlamaForCausalLM is first pretrained (all weights, resident, no
stagehand) on one part of real text (the Python standard library's source,
`torch_stagehand.app.textdata`), so the blocks have real pretrained structure;
then each run LoRA-tunes a copy of it through stagehand on another part of the
text, same seed and data order, and is evaluated on a held-out part:

  bf16         precision="bf16"
  int8         precision="int8"
  dynamic      precision="auto" (the selective-precision policy, seed defaults, calibrated first)
  dynamic_from_int8  the same policy and defaults with the user's starting map all int8
               (precision="int8", mode "dynamic"): ambiguous blocks keep int8, a block scored
               at or above bf16_threshold goes back to bf16
  dynamic_fp8  the same, blocks sent down take fp8 where the FP8 policy file measured every
               layer faster than bf16 (the file is measured in this run on an FP8 GPU;
               on the CPU only with --fp8-emulate, which forces fp8 and says so: no speed claim)

Reported per run: final loss (mean of the last 100 steps, or the last quarter
when shorter), eval loss, H2D bytes per step measured from the runtime's
counters (and vs bf16), median step time, switches, blocks in each precision
at the end. PNG: loss curves and the per-block precision map over steps.

    python benches/convergence.py --steps 1000                        # GPU
    python benches/convergence.py --tiny --device cpu                 # smoke (a minute)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, env_info, print_header, print_table, write_json  # noqa: E402

import torch_stagehand as stagehand  # noqa: E402
from torch_stagehand.app.textdata import ByteBatches, stdlib_corpus  # noqa: E402
from torch_stagehand.config import Config  # noqa: E402
from torch_stagehand.runtime.precision.fp8 import has_fp8_tensor_cores  # noqa: E402
from torch_stagehand.runtime.selective import fp8_rules  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {
    "tiny": dict(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, seq=32, batch=2, dtype="float32",
                 inner="eager", corpus_bytes=200_000, lr=3e-3, pretrain_lr=3e-3),
    "gpu": dict(layers=12, hidden=768, intermediate=2048, heads=12, kv_heads=4, seq=256, batch=16, dtype="bfloat16",
                inner="inductor", corpus_bytes=4_000_000, lr=1e-3, pretrain_lr=1e-3),
}
CODES = {"bf16": 0, "int8": 1, "fp8": 2}  # the heatmap's colours; by-role maps ("int8-mlp", granularity "layer") 3


def build(shape: dict, state: dict | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["seq"],
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if state is not None:
        model.load_state_dict(state)
    return model


def pretrain(shape: dict, data: torch.Tensor, steps: int, device: torch.device) -> dict:
    """All weights, resident, fp32 master: the structure the LoRA runs start from."""
    model = build(shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=shape["pretrain_lr"])
    batches = ByteBatches(data, shape["batch"], shape["seq"], seed=1)
    start, losses = time.perf_counter(), []
    for step in range(steps):
        ids = batches.next().to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 5) == 0:
            print(f"  pretrain step {step + 1}/{steps}: loss {statistics.mean(losses[-20:]):.3f}", flush=True)
    print(f"  pretrained in {time.perf_counter() - start:.0f}s", flush=True)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def fp8_policy_for(shape: dict, out_dir: str, emulate: bool) -> str:
    """The FP8 policy file for this model's layer shapes: measured here, or forced for the CPU emulation."""
    h, i = shape["hidden"], shape["intermediate"]
    kv = h // shape["heads"] * shape["kv_heads"]
    shapes = sorted({(h, h), (kv, h), (i, h), (h, i)})
    tokens = shape["batch"] * shape["seq"]
    path = os.path.join(out_dir, "fp8_policy.json")
    if emulate:
        rules = [fp8_rules.Fp8Rule(n, k, 1, float("inf")) for n, k in shapes]
        fp8_rules.save(fp8_rules.Fp8Policy("cpu (emulated: forced, not measured)", 1.0, rules), path)
        return path
    from torch_stagehand.runtime.selective.fp8_bench import measure

    rows = measure(shapes, [tokens])
    fp8_rules.save(fp8_rules.Fp8Policy(torch.cuda.get_device_name(), 1.0, fp8_rules.rules_from_measurements(rows)), path)
    return path


def run_one(name: str, shape: dict, state: dict, data: dict, args, device: torch.device, fp8_file: str | None) -> dict:
    import peft

    model = build(shape, state).to(getattr(torch, shape["dtype"]))
    model.requires_grad_(False)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                           target_modules=LORA_TARGETS))
    sp = dict(json.loads(args.sp), telemetry_file=os.path.join(args.work, f"sp_{name}.jsonl"),
              calibration_cache_dir=os.path.join(args.work, "calibration"))
    if name == "dynamic_fp8":
        sp.update(fp8_policy_file=fp8_file, fp8_tokens=shape["batch"] * shape["seq"],
                  fp8_emulate=device.type != "cuda" or not has_fp8_tensor_cores(device))
    precision = {"bf16": "bf16", "int8": "int8", "dynamic_from_int8": "int8"}.get(name, "auto")
    if name == "dynamic_from_int8":
        sp.setdefault("mode", "dynamic")  # a mode set: `precision` is the starting map
    config = Config.from_dict({"selective_precision": sp if name.startswith("dynamic") else {}})
    rt = stagehand.offload(model, device=device, precision=precision, config=config)
    train_batches = ByteBatches(data["finetune"], shape["batch"], shape["seq"], seed=2)
    if rt.selective is not None:
        calib = ByteBatches(data["finetune"], shape["batch"], shape["seq"], seed=3)
        rt.calibrate([{"input_ids": calib.next().to(device)} for _ in range(rt.selective.cfg.calibration_samples)])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": shape["inner"]})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=shape["lr"])
    rt.attach(opt)
    losses, times, maps = [], [], []
    h2d_after_first = None
    for step in range(args.steps):
        ids = train_batches.next().to(device)
        start = time.perf_counter()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        rt.observe_loss(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the bench's own sync: step times need one anyway
        times.append(time.perf_counter() - start)
        maps.append([CODES.get(rt.precision[b], 3) for b in range(len(rt.blocks))])
        if step == 0:
            h2d_after_first = rt.stats()["h2d_bytes"]
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(f"  {name}: step {step + 1}/{args.steps} loss {statistics.mean(losses[-20:]):.3f} "
                  f"map {''.join('.ifm'[c] for c in maps[-1])}", flush=True)
    h2d_per_step = (rt.stats()["h2d_bytes"] - h2d_after_first) / max(1, args.steps - 1)
    eval_batches = ByteBatches(data["eval"], shape["batch"], shape["seq"], seed=4)
    with torch.no_grad():
        eval_loss = statistics.mean(compiled(input_ids=(ids := eval_batches.next().to(device)), labels=ids).loss.item()
                                    for _ in range(args.eval_batches))
    tail = min(100, max(1, len(losses) // 4))
    final = rt.precision
    summary = rt.selective.summary() if rt.selective is not None else {}
    row = {"run": name, "final_loss": statistics.mean(losses[-tail:]), "eval_loss": eval_loss,
           "h2d_mb_per_step": h2d_per_step / 1e6, "step_ms": 1e3 * statistics.median(times[min(5, len(times) - 1):]),
           "switches": summary.get("switches", 0), "bf16_blocks": sum(p == "bf16" for p in final.values()),
           "int8_blocks": sum(p == "int8" for p in final.values()), "fp8_blocks": sum(p == "fp8" for p in final.values()),
           "mixed_blocks": sum(p not in CODES for p in final.values()),
           "fp8_emulated": bool(sp.get("fp8_emulate")) if name == "dynamic_fp8" else None}
    rt.restore()
    return {"row": row, "losses": losses, "maps": maps}


def figure(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dynamic = [n for n in results if n.startswith("dynamic")]
    fig, axes = plt.subplots(1 + len(dynamic), 1, figsize=(10, 3.2 * (1 + len(dynamic))), squeeze=False)
    ax = axes[0][0]
    for name, res in results.items():
        losses = torch.tensor(res["losses"])
        k = max(1, len(losses) // 50)
        smooth = torch.nn.functional.avg_pool1d(losses[None, None], k, 1)[0, 0] if k > 1 else losses
        ax.plot(range(k - 1, k - 1 + len(smooth)), smooth.tolist(), label=name)
    ax.set(xlabel="step", ylabel="train loss (smoothed)", title="LoRA on real text, same seed and data order")
    ax.legend()
    cmap = matplotlib.colors.ListedColormap(["#4c72b0", "#dd8452", "#55a868", "#c44e52"])
    for ax, name in zip((a[0] for a in axes[1:]), dynamic):
        maps = torch.tensor(results[name]["maps"]).T
        ax.imshow(maps, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=3)
        ax.set_yticks(range(maps.shape[0]))
        ax.set(xlabel="step", ylabel="block", title=f"{name}: precision per block (blue bf16, orange int8, green fp8, red attn/MLP mixed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small model and few steps (CPU smoke)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=None, help="LoRA steps per run (default 1000; --tiny 16)")
    ap.add_argument("--pretrain-steps", type=int, default=None, help="default 400; --tiny 20")
    ap.add_argument("--eval-batches", type=int, default=None)
    ap.add_argument("--runs", default="bf16,int8,dynamic,dynamic_fp8")
    ap.add_argument("--sp", default="{}", help="selective_precision overrides as JSON (default: the seed's)")
    ap.add_argument("--fp8-emulate", action="store_true", help="run dynamic_fp8 without FP8 tensor cores (forced)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "convergence.json"))
    ap.add_argument("--work", default="/tmp/stagehand-convergence")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = dict(SHAPES["tiny" if args.tiny else "gpu"])
    args.steps = args.steps or (16 if args.tiny else 1000)
    pretrain_steps = args.pretrain_steps if args.pretrain_steps is not None else (20 if args.tiny else 400)
    args.eval_batches = args.eval_batches or (2 if args.tiny else 20)
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    info = print_header(env_info())
    text, _ = stdlib_corpus(shape["corpus_bytes"])
    n = text.numel()
    data = {"pretrain": text[: n // 2], "finetune": text[n // 2 : n * 9 // 10], "eval": text[n * 9 // 10 :]}
    print(f"corpus: {n} bytes (pretrain {n // 2}, finetune {n * 4 // 10}, eval {n // 10}); shape {shape}", flush=True)
    state = pretrain(shape, data["pretrain"], pretrain_steps, device)
    runs = args.runs.split(",")
    fp8_file = None
    if "dynamic_fp8" in runs:
        if has_fp8_tensor_cores(device) or args.fp8_emulate:
            fp8_file = fp8_policy_for(shape, args.work, emulate=not has_fp8_tensor_cores(device))
        else:
            print("dynamic_fp8: skipped (no FP8 tensor cores here; --fp8-emulate forces an emulated run)", flush=True)
            runs.remove("dynamic_fp8")
    results = {}

    def save(final: bool) -> None:
        """The JSON of the runs so far (after every run: a run cut off by a time limit loses only itself)."""
        rows = [dict(r["row"]) for r in results.values()]
        base = results.get("bf16", {}).get("row")
        for row in rows:
            if base:
                row["eval_vs_bf16_pct"] = 100 * (row["eval_loss"] / base["eval_loss"] - 1)
                row["bytes_vs_bf16_pct"] = 100 * (row["h2d_mb_per_step"] / base["h2d_mb_per_step"] - 1)
                row["bf16_step_ms_over_this"] = base["step_ms"] / row["step_ms"]
        if final:
            print_table(rows, title=f"convergence: {args.steps} LoRA steps after {pretrain_steps} pretraining steps "
                                    f"(baseline bf16 measured in this run)")
            figure(results, os.path.splitext(args.out)[0] + ".png")
        write_json(args.out, {"env": info, "shape": shape, "steps": args.steps, "pretrain_steps": pretrain_steps,
                              "complete": final, "sp_overrides": json.loads(args.sp),
                              "fp8_policy": fp8_file and json.load(open(fp8_file)),
                              "rows": rows, "losses": {k: v["losses"] for k, v in results.items()},
                              "precision_maps": {k: v["maps"] for k, v in results.items() if k.startswith("dynamic")}})

    for name in runs:
        print(f"run {name}", flush=True)
        results[name] = run_one(name, shape, copy.deepcopy(state), data, args, device, fp8_file)
        save(final=name == runs[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
