"""LoRA fine-tuning of a transformers causal LM through the stagehand backend, from a checkpoint folder.

    python examples/lora_causal_lm.py path/to/model-folder --text train.txt --steps 100 --out lora-out

The folder is what `save_pretrained` writes (or a downloaded Hub snapshot): config, weights, tokenizer.
The run: load -> freeze -> peft LoRA on every Linear -> offload (block weights stream from host
memory) -> torch.compile(backend="stagehand") -> train -> save the adapter with peft's
`save_pretrained` -> load it back into the plain transformers model and check the outputs match.
"""

import argparse
import sys

import peft
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import torch_stagehand as stagehand

from _checkpoint import CAUSAL_LM, require_checkpoint  # beside this script


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a folder with config.json, weights and a tokenizer")
    p.add_argument("--text", default=__file__, help="a UTF-8 text file to train on (default: this script)")
    p.add_argument("--out", default="lora-causal-lm", help="where the adapter is saved")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--precision", default="bf16", help="bf16, int8 (half the bytes over PCIe) or a map like 0:int8")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inner = "inductor" if device.type == "cuda" else "eager"  # Inductor's C++ compile is slow on a CPU

    require_checkpoint(args.model, "causal LM", CAUSAL_LM)  # a missing folder is not a Hub id to look up
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(open(args.text, encoding="utf-8").read(), return_tensors="pt").input_ids[0]
    if ids.numel() <= args.seq:
        sys.exit(f"{args.text}: {ids.numel()} tokens, need more than --seq {args.seq}")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)  # on the CPU: offload streams from there
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                       target_modules="all-linear"))  # peft, here before offload
    precision = args.precision if args.precision in ("bf16", "int8") else {
        int(b): p for b, p in (kv.split(":") for kv in args.precision.split(","))}
    rt = stagehand.offload(model, device=device, precision=precision)
    compiled = torch.compile(model, backend="stagehand", options={"inner": inner})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    rt.attach(optimizer)

    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        starts = torch.randint(0, ids.numel() - args.seq, (args.batch,), generator=gen)
        batch = torch.stack([ids[s:s + args.seq] for s in starts.tolist()]).to(device)
        loss = compiled(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    print(f"streamed {rt.stats()['h2d_bytes'] / 1e6:,.1f} MB host->device in {args.steps} steps")

    model.save_pretrained(args.out)  # peft: adapter_config.json + adapter_model.safetensors
    print(f"saved the adapter to {args.out}")

    # The adapter in the plain library model: the same outputs as the trained model.
    rt.restore()  # plain nn.Linear modules again
    model.to(device).eval()
    probe = batch[:1]
    with torch.no_grad():
        trained = model(input_ids=probe).logits
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
        reloaded = peft.PeftModel.from_pretrained(base, args.out).eval()
        again = reloaded(input_ids=probe).logits
    diff = (trained - again).abs().max().item()
    print(f"reloaded with PeftModel.from_pretrained: max |logits difference| = {diff:.3g}")
    torch.testing.assert_close(again, trained)
    return diff


if __name__ == "__main__":
    main()
