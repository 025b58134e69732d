"""Full-size models from their own libraries, in the set-up people train them in.

    python benches/models.py --model flux --out benches/results/models_flux.json
    python benches/models.py --model qwen --out benches/results/models_qwen.json
    python benches/models.py --model flux --tiny --device cpu      # a smoke test of the bench itself

* flux: diffusers `FluxTransformer2DModel` at Flux-dev size (19 double + 38
  single blocks, 11.9B parameters), 4096 image + 512 text tokens;
* qwen: transformers `Qwen2ForCausalLM` at Qwen2.5-7B shape (28 layers,
  7.6B parameters), sequence 2048.

Both: random init directly on the GPU, bf16, base frozen, peft LoRA r=16 on
the attention projections, AdamW on the adapters, the model's own gradient
checkpointing on (`--ckpt on`), off, or both. The model is built once; every
row is measured on it in this one process, in this order:

1. the resident baselines (same checkpointing): "resident (eager)" and
   "resident (inductor)", the plain model under `torch.compile` with its
   default backend and options (`--no-resident-compile` leaves it out; its
   first step is its compile, `--inductor-limit-s` bounds it). Every row has
   `ratio_inductor` (to the compiled one, the ratio that counts, printed
   first) and `ratio_eager`; `ratio` is the old field (= ratio_eager);
2. `offload()` (the weights go to pinned host memory; the timing includes
   quantizing to INT8), then stagehand with the inductor inner compiler, for
   the maps int8, bf16 and mixed (first and last two blocks bf16, the rest
   int8): one compiled program, re-linked per map.

Per row: median step time (after a warm-up step), peak GPU memory allocated
and reserved over the timed steps and over the first step alone, H2D GB per
step, the PCIe floor (those bytes over the pinned H2D bandwidth measured at
the start), synchronous fetches per step after the first, eager-op calls,
offload and first-step seconds. torch 2.11's cuDNN SDPA backward fails at
Flux's full shape on the H100, so the cuDNN SDPA backend is disabled for
every row (resident included) and the JSON says so.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
from _common import (PEAK_COLUMNS, RATIO_COLUMNS, RATIOS_NOTE, RESULTS, Sync, add_ratios, env_info, first_step,
                     inductor_settings, print_header, print_rows, resident_row, write_json)

import torch_stagehand as stagehand

LORA_TARGETS = {"flux": ["to_q", "to_k", "to_v", "to_out.0"], "qwen": ["q_proj", "k_proj", "v_proj", "o_proj"]}
LORA_TARGETS["qwen32"] = LORA_TARGETS["qwen"]


def flux_config(tiny: bool) -> dict:
    """FluxTransformer2DModel keyword arguments: Flux-dev size, or a small one of the same class."""
    cfg = dict(num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=2,
               joint_attention_dim=32, pooled_projection_dim=32, in_channels=16, axes_dims_rope=(4, 6, 6)) if tiny else {}
    return dict(guidance_embeds=True, **cfg)


def flux_inputs(cfg: dict, tiny: bool, device: str):
    img, txt = (32, 8) if tiny else (4096, 512)
    g = torch.Generator(device=device).manual_seed(1)
    jd, pd, ic = cfg.get("joint_attention_dim", 4096), cfg.get("pooled_projection_dim", 768), cfg.get("in_channels", 64)
    bf = dict(device=device, dtype=torch.bfloat16)
    inputs = dict(hidden_states=torch.randn(1, img, ic, generator=g, **bf),
                  encoder_hidden_states=torch.randn(1, txt, jd, generator=g, **bf),
                  pooled_projections=torch.randn(1, pd, generator=g, **bf),
                  timestep=torch.tensor([0.5], device=device), guidance=torch.tensor([3.5], device=device),
                  img_ids=torch.zeros(img, 3, device=device), txt_ids=torch.zeros(txt, 3, device=device),
                  return_dict=False)
    return inputs, {"image_tokens": img, "text_tokens": txt}


def build_flux(tiny: bool, device: str):
    from diffusers import FluxTransformer2DModel

    cfg = flux_config(tiny)
    with torch.device(device):
        model = FluxTransformer2DModel(**cfg).to(torch.bfloat16)
    inputs, shape = flux_inputs(cfg, tiny, device)
    return model, inputs, shape


def qwen_config(tiny: bool, size: str = "7b"):
    """Qwen2.5-7B's shape (`size="7b"`), Qwen2.5-32B's (`"32b"`), or a small one of the same class."""
    from transformers import Qwen2Config

    if size == "32b" and not tiny:  # Qwen2.5-32B: 64 layers, 32.8B parameters
        config = Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                             num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
                             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    elif tiny:
        config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2)
    else:  # Qwen2.5-7B
        config = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                             num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def qwen_inputs(config, tiny: bool, device: str):
    seq = 64 if tiny else 2048
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    return {"input_ids": ids, "labels": ids}, {"sequence": seq}


def build_qwen(tiny: bool, device: str, size: str = "7b"):
    from transformers import Qwen2ForCausalLM

    config = qwen_config(tiny, size)
    default = torch.get_default_dtype()
    if size == "32b":  # 131 GB in fp32 would not fit the GPU it is built on: built in bf16 directly
        torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default)
    inputs, shape = qwen_inputs(config, tiny, device)
    return model, inputs, shape


def set_checkpointing(kind: str, model, on: bool) -> None:
    base = model.get_base_model()
    if kind == "flux":
        base.enable_gradient_checkpointing() if on else base.disable_gradient_checkpointing()
    elif on:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_disable()
    model.train()


def loss_of(kind: str, out) -> torch.Tensor:
    return out[0].float().square().mean() if kind == "flux" else out.loss


def pinned_h2d_gbps(nbytes: int = 512 * 2**20, reps: int = 8, direction: str = "h2d") -> float:
    """GB/s of copies between pinned host memory and the GPU, host-to-device (or "d2h")."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def cuda_preamble(results: dict, device: str) -> None:
    """On CUDA: cuDNN's SDPA off for every row (said in the results) and the pinned H2D bandwidth measured."""
    if device != "cuda":
        return
    torch.backends.cuda.enable_cudnn_sdp(False)
    results["cudnn_sdp"] = "disabled for every row (torch 2.11 cuDNN SDPA backward faults at Flux's shape)"
    results["pinned_h2d_gbps"] = round(pinned_h2d_gbps(), 1)
    print(f"pinned H2D {results['pinned_h2d_gbps']} GB/s", flush=True)


def measure(label: str, step, steps: int, sync: Sync, rt=None) -> dict:
    """First step (compile + warm-up) timed on its own with its own peaks, then the median of `steps` and their
    peaks (allocated and reserved, counted from after the first step)."""
    first_before = (rt.stats(), dynamo_seconds()) if rt is not None else None
    first = first_step(step, sync)
    sync.reset_peak()
    before = rt.stats() if rt is not None else None
    times, host = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)  # until the host had issued the step's work
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        print(f"  {label}: step {i + 1}/{steps} {times[-1]:.0f} ms (host {host[-1]:.0f} ms)", flush=True)
    row = {"mode": label, "step_ms": round(statistics.median(times), 1), "steps_ms": [round(t, 1) for t in times],
           "host_ms": round(statistics.median(host), 1), **sync.peaks(), **first}
    if rt is not None:
        stats0, dynamo0 = first_before
        row["first_step_parts_s"] = {  # what the first step was made of
            "dynamo_capture": round(dynamo_seconds() - dynamo0, 1),
            "aot_inductor": round(before["compile_seconds"] - stats0["compile_seconds"], 1),
            "w8a16_autotune": round(before["autotune_seconds"] - stats0["autotune_seconds"], 1),
        }
        after = rt.stats()
        row.update(
            h2d_gb_step=round((after["h2d_bytes"] - before["h2d_bytes"]) / steps / 1e9, 3),
            sync_fetches_step=(after["sync_fetches"] - before["sync_fetches"]) / steps,
            eager_linear_calls=after["eager_linear_calls"],
            recomputed_blocks_step=(after["recomputed_blocks"] - before["recomputed_blocks"]) / steps,
            compiled_variants=after["compiled_variants"],
        )
    return row


def dynamo_seconds() -> float:
    """Seconds Dynamo has spent capturing frames in this process (its own timer)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


def profile_step(step) -> str:
    """One step under torch.profiler: the ops by GPU time and by host time (what bounds the step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    text = (averages.table(sort_by="cuda_time_total", row_limit=20) + "\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=15))
    print(text, flush=True)
    return text


def make_step(kind: str, model, fn, inputs, optimizer):
    def step():
        loss = loss_of(kind, fn(**inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def mixed_map(n: int) -> dict[int, str]:
    return {b: "bf16" if b < 2 or b >= n - 2 else "int8" for b in range(n)}


def run(args) -> dict:
    import peft

    device = args.device
    sync = Sync(device)
    env = print_header(env_info())
    results: dict = {"env": env, "model": args.model, "tiny": args.tiny, "rows": []}
    cuda_preamble(results, device)

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, inputs, shape = (build_flux if args.model == "flux" else build_qwen)(args.tiny, device)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS[args.model]))
    results.update(shape=shape, build_s=round(time.perf_counter() - t0, 1),
                   params_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 2))
    print(f"built {args.model}: {results['params_b']}B parameters in {results['build_s']} s", flush=True)
    lora = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-5)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.ckpt]
    rows = results["rows"]

    results["inductor"] = inductor_settings()
    results["ratios"] = RATIOS_NOTE
    baselines: dict[bool, dict[str, dict]] = {ckpt: {} for ckpt in modes}

    def with_ratios(row: dict) -> dict:
        add_ratios(row, baselines[row["ckpt"]])
        if row.get("ratio_eager") is not None:
            row["ratio"] = row["ratio_eager"]  # the field's old meaning (before ratio_inductor existed)
        return row

    def add(row: dict, ckpt: bool) -> None:
        row["ckpt"] = ckpt
        with_ratios(row)
        if "h2d_gb_step" in row and results.get("pinned_h2d_gbps"):
            row["floor_ms"] = round(row["h2d_gb_step"] / results["pinned_h2d_gbps"] * 1e3, 1)
            row["vs_floor"] = round(row["step_ms"] / row["floor_ms"], 3) if row["floor_ms"] else None
        rows.append(row)
        print({k: v for k, v in row.items() if k != "steps_ms"}, flush=True)

    def measured(label: str, step) -> dict:
        return measure(label, step, args.steps, sync)

    for ckpt in modes:
        set_checkpointing(args.model, model, ckpt)
        for compiler in ("eager", "inductor") if args.resident_compile else ("eager",):
            row = resident_row(compiler, model, lambda fn: make_step(args.model, model, fn, inputs, optimizer),
                               measured, limit_s=args.inductor_limit_s)
            baselines[ckpt][compiler] = row
            row["ckpt"] = ckpt
            rows.append(row)
        for row in baselines[ckpt].values():  # both measured: each baseline's ratio to the other
            with_ratios(row)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    t0 = time.perf_counter()
    rt = stagehand.offload(model, device=device, precision="int8")
    sync()
    results["offload_s"] = round(time.perf_counter() - t0, 1)
    results["offload_stats"] = {k: rt.stats()[k] for k in ("blocks", "streamed_layers", "slots", "slot_bytes", "host_bytes")}
    n = len(rt.blocks)
    results["streamed_bytes"] = {p: sum(rt.block_nbytes(b, p) for b in range(n)) for p in ("int8", "bf16")}
    print(f"offload: {n} blocks in {results['offload_s']} s; streamed int8 {results['streamed_bytes']['int8'] / 1e9:.2f} GB,"
          f" bf16 {results['streamed_bytes']['bf16'] / 1e9:.2f} GB", flush=True)
    if device == "cuda":
        torch.cuda.empty_cache()
    rt.attach(optimizer)
    maps = {"int8": "int8", "bf16": "bf16", "mixed": mixed_map(n)}
    for ckpt in modes:
        set_checkpointing(args.model, model, ckpt)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="stagehand")
        for name in args.maps:
            rt.set_precision(maps[name])
            try:
                row = measure(f"stagehand {name}", make_step(args.model, model, compiled, inputs, optimizer),
                              args.steps, sync, rt)
            except torch.OutOfMemoryError:
                row = {"mode": f"stagehand {name}", "error": "out of GPU memory"}
            add(row, ckpt)
            if args.profile == name and device == "cuda" and "error" not in row:
                results.setdefault("profiles", {})[f"{name}, ckpt {ckpt}"] = profile_step(
                    make_step(args.model, model, compiled, inputs, optimizer))
    results["stats"] = rt.stats()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["flux", "qwen"], required=True)
    parser.add_argument("--ckpt", choices=["on", "off", "both"], default="both")
    parser.add_argument("--maps", nargs="+", default=["int8", "bf16", "mixed"], choices=["int8", "bf16", "mixed"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a small config of the same class (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--resident-compile", action=argparse.BooleanOptionalAction, default=True,
                        help="time the resident model under torch.compile (Inductor) beside eager (default: on; the "
                             "ratio to it is the one reported first)")
    parser.add_argument("--inductor-limit-s", type=float, default=0,
                        help="stop a resident Inductor row after this many seconds, compile included (0: no limit)")
    parser.add_argument("--profile", choices=["int8", "bf16", "mixed"], default=None,
                        help="also profile one step of this map (GPU), tables into the JSON")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = run(args)
    cols = ["ckpt", "mode", "step_ms", "host_ms", *RATIO_COLUMNS, *PEAK_COLUMNS, "h2d_gb_step", "floor_ms", "vs_floor",
            "sync_fetches_step", "recomputed_blocks_step", "eager_linear_calls", "compile_s", "error"]
    print_rows(results["rows"], cols, title=f"{args.model}: {results['params_b']}B parameters, {results['shape']}, "
                                            f"offload {results['offload_s']} s, {results['env']['device']}")
    out = args.out or os.path.join(RESULTS, f"models_{args.model}{'_tiny' if args.tiny else ''}.json")
    write_json(out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
