"""LoRA fine-tuning in an `accelerate` loop, compiled with the stagehand backend; save_state / load_state.

    python examples/accelerate_loop.py path/to/model-folder --text train.txt --steps 100 --out accel-out
    python examples/accelerate_loop.py path/to/model-folder --steps 200 --out accel-out --resume
    accelerate launch --num_processes 2 examples/accelerate_loop.py path/to/model-folder   # DDP, 2 GPUs (or torchrun)

The model is offloaded before `accelerator.prepare`; `stagehand_dynamo_plugin()` makes prepare
compile it with backend="stagehand"; `rt.attach` takes the prepared (wrapped) optimizer.
"""

import argparse
import os

import peft
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer

import torch_stagehand as stagehand
from torch_stagehand.trainers import stagehand_dynamo_plugin

from _checkpoint import CAUSAL_LM, require_checkpoint  # beside this script


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a folder with config.json, weights and a tokenizer")
    p.add_argument("--text", default=__file__, help="a UTF-8 text file to train on (default: this script)")
    p.add_argument("--out", default="accel-out")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--precision", default="bf16", help="bf16 or int8")
    p.add_argument("--resume", action="store_true", help="load_state from the last state in --out")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require_checkpoint(args.model, "causal LM", CAUSAL_LM)  # a missing folder is not a Hub id to look up
    set_seed(0)  # LoRA's initial A, the shuffle: a resumed run continues the same run
    on_gpu = torch.cuda.is_available()
    accelerator = Accelerator(cpu=not on_gpu,
                              dynamo_plugin=stagehand_dynamo_plugin({} if on_gpu else {"inner": "eager"}))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(open(args.text, encoding="utf-8").read(), return_tensors="pt").input_ids[0]
    windows = ids[: (ids.numel() // args.seq) * args.seq].view(-1, args.seq)
    loader = torch.utils.data.DataLoader(windows, batch_size=args.batch, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0))

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    rt = stagehand.offload(model, device=accelerator.device, precision=args.precision)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    compiled, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    rt.attach(optimizer)  # the AcceleratedOptimizer: attach finds the optimizer inside

    step = 0
    states = sorted((d for d in os.listdir(args.out) if d.startswith("step-")), key=lambda d: int(d[5:])) \
        if args.resume and os.path.isdir(args.out) else []
    if states:
        accelerator.load_state(os.path.join(args.out, states[-1]))  # model (adapters), optimizer, RNG
        step = int(states[-1][5:])
    while step < args.steps:
        for batch in accelerator.skip_first_batches(loader, step % len(loader)) if step else loader:
            loss = compiled(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            print(f"step {step}: loss {loss.item():.4f}")
            if step % args.save_every == 0:
                # safe_serialization=False: safetensors' load_model refuses the offloaded model (its streamed
                # weights are views into one host buffer per block); torch.save / load_state_dict take it.
                accelerator.save_state(os.path.join(args.out, f"step-{step}"), safe_serialization=False)
            if step >= args.steps:
                break
    print(f"stagehand ran {rt.stats()['steps']} steps here, streamed {rt.stats()['h2d_bytes'] / 1e6:,.1f} MB")
    # As accelerate's docs say: under torchrun the process group goes down before the process exits (a gloo
    # group left to the interpreter's exit can abort a rank in its C++ teardown).
    accelerator.end_training()
    return model, rt


if __name__ == "__main__":
    main()
