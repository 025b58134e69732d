"""LoRA fine-tuning of a diffusers Flux transformer through the stagehand backend, from a checkpoint folder.

    python examples/lora_flux.py path/to/FLUX.1-dev --cache latents.pt --steps 500 --out flux-lora

The folder is a diffusers pipeline (its `transformer/` subfolder is used) or a transformer folder
alone. Like musubi-tuner and diffusers' training scripts, training reads cached inputs: `--cache`
is a `torch.save`d dict of VAE latents packed to tokens ("latents" [N, image tokens, channels]),
T5 "prompt_embeds" [N, text tokens, dim], CLIP "pooled" [N, dim], "img_ids", "txt_ids" (the
pipeline's `encode_prompt`, `vae.encode` and `_pack_latents` make them). Without `--cache`, random
inputs of the model's shapes stand in (a smoke run). The loss is rectified flow matching.

The run: load -> freeze -> peft LoRA on the attention projections -> offload -> torch.compile(
backend="stagehand") -> train -> save the adapter with peft's `save_pretrained` -> load it back
into the plain diffusers model with diffusers' own `load_lora_adapter` (what `pipe.transformer`
takes) and check the outputs match.
"""

import argparse
import os

import peft
import torch
from diffusers import FluxTransformer2DModel

import torch_stagehand as stagehand

from _checkpoint import DIFFUSERS_MODEL, require_checkpoint  # beside this script

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # diffusers' Flux LoRA scripts' default


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a diffusers Flux pipeline folder (with transformer/) or a transformer folder")
    p.add_argument("--cache", default=None, help="torch.save'd dict of latents / prompt_embeds / pooled / ids")
    p.add_argument("--out", default="lora-flux", help="where the adapter is saved")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--precision", default="bf16", help="bf16, int8 (half the bytes over PCIe) or a map like 0:int8")
    p.add_argument("--checkpointing", action="store_true", help="the model's own gradient checkpointing (runs compiled)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def transformer_subfolder(folder):
    return "transformer" if os.path.isdir(os.path.join(folder, "transformer")) else None


def load_transformer(folder, dtype):
    return FluxTransformer2DModel.from_pretrained(folder, subfolder=transformer_subfolder(folder), torch_dtype=dtype)


def load_cache(path, config, batch):
    if path is not None:
        return torch.load(path)
    gen = torch.Generator().manual_seed(0)  # a smoke run: the model's shapes, random values
    image_tokens, text_tokens = 64, 16
    return {"latents": torch.randn(batch * 4, image_tokens, config.in_channels, generator=gen),
            "prompt_embeds": torch.randn(batch * 4, text_tokens, config.joint_attention_dim, generator=gen),
            "pooled": torch.randn(batch * 4, config.pooled_projection_dim, generator=gen),
            "img_ids": torch.zeros(image_tokens, 3), "txt_ids": torch.zeros(text_tokens, 3)}


def model_inputs(cache, index, noisy, t, config, device, dtype):
    inputs = {"hidden_states": noisy, "timestep": t, "return_dict": False,
              "encoder_hidden_states": cache["prompt_embeds"][index].to(device, dtype),
              "pooled_projections": cache["pooled"][index].to(device, dtype),
              "img_ids": cache["img_ids"].to(device, dtype), "txt_ids": cache["txt_ids"].to(device, dtype)}
    if config.guidance_embeds:
        inputs["guidance"] = torch.full_like(t, 3.5)
    return inputs


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inner = "inductor" if device.type == "cuda" else "eager"  # Inductor's C++ compile is slow on a CPU

    sub = transformer_subfolder(args.model)  # a pipeline's transformer/, else the folder itself
    require_checkpoint(args.model, "diffusers Flux", DIFFUSERS_MODEL,
                       inside=os.path.join(args.model, sub) if sub else args.model)
    model = load_transformer(args.model, dtype)  # on the CPU: offload streams from there
    config = model.config
    cache = load_cache(args.cache, config, args.batch)
    model.requires_grad_(False)
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS))
    precision = args.precision if args.precision in ("bf16", "int8") else {
        int(b): p for b, p in (kv.split(":") for kv in args.precision.split(","))}
    rt = stagehand.offload(model, device=device, precision=precision)  # double and single blocks both stream
    compiled = torch.compile(model, backend="stagehand", options={"inner": inner})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    rt.attach(optimizer)

    gen = torch.Generator().manual_seed(0)
    n = cache["latents"].shape[0]
    for step in range(args.steps):
        index = torch.randint(0, n, (args.batch,), generator=gen)
        x0 = cache["latents"][index].to(device, dtype)
        noise = torch.randn(x0.shape, generator=gen).to(device, dtype)
        t = torch.sigmoid(torch.randn(args.batch, generator=gen)).to(device, dtype)  # logit-normal timesteps
        noisy = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
        pred = compiled(**model_inputs(cache, index, noisy, t, config, device, dtype))[0]
        loss = torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())  # flow matching: predict noise - x0
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    print(f"streamed {rt.stats()['h2d_bytes'] / 1e6:,.1f} MB host->device in {args.steps} steps")

    model.save_pretrained(args.out)  # peft: adapter_config.json + adapter_model.safetensors
    print(f"saved the adapter to {args.out}")

    # The adapter in the plain diffusers model (pipe.transformer takes it the same way).
    rt.restore()
    model.to(device).eval()
    probe = model_inputs(cache, index[:1], noisy[:1], t[:1], config, device, dtype)
    with torch.no_grad():
        trained = model(**probe)[0]
        plain = load_transformer(args.model, dtype).to(device)
        plain.load_lora_adapter(args.out, weight_name="adapter_model.safetensors", prefix="base_model.model")
        again = plain(**probe)[0]
    diff = (trained - again).abs().max().item()
    print(f"reloaded with diffusers' load_lora_adapter: max |output difference| = {diff:.3g}")
    # Within bf16 rounding: peft and diffusers apply the adapter in different op orders, which on
    # a GPU moves some outputs by one bf16 step (measured on an H100: at most 0.0039).
    torch.testing.assert_close(again, trained, atol=1e-2, rtol=1.6e-2)
    return diff


if __name__ == "__main__":
    main()
