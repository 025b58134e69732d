"""LoRA fine-tuning with the Hugging Face `Trainer`, compiled with the stagehand backend.

    python examples/hf_trainer.py path/to/model-folder --text train.txt --steps 100 --out trainer-out
    python examples/hf_trainer.py path/to/model-folder --steps 200 --out trainer-out --resume   # from the last checkpoint
    torchrun --nproc_per_node=2 examples/hf_trainer.py path/to/model-folder --out trainer-out     # DDP, 2 GPUs

The model is offloaded before the Trainer wraps it; `TrainingArguments(torch_compile=True,
torch_compile_backend="stagehand")` does the compile. `StagehandTrainer` is a `Trainer` that
accelerate accepts that backend name from, and that attaches its optimizer to the runtime.
Checkpoints are peft adapters (plus optimizer and scheduler state), as with any peft model.
After training, the adapter is saved to OUT/adapter with peft's `save_pretrained`, loaded back into
the plain transformers model, and its outputs checked against the trained model's.
"""

import argparse
import os

import peft
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments, set_seed

import torch_stagehand as stagehand
from torch_stagehand.trainers import StagehandTrainer

from _checkpoint import CAUSAL_LM, require_checkpoint  # beside this script


class Windows(torch.utils.data.Dataset):
    """Fixed-length windows of a token sequence; each is its own label (causal LM)."""

    def __init__(self, ids, seq):
        self.ids, self.seq = ids, seq

    def __len__(self):
        return (self.ids.numel() - 1) // self.seq

    def __getitem__(self, i):
        window = self.ids[i * self.seq:(i + 1) * self.seq]
        return {"input_ids": window, "labels": window}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a folder with config.json, weights and a tokenizer")
    p.add_argument("--text", default=__file__, help="a UTF-8 text file to train on (default: this script)")
    p.add_argument("--out", default="trainer-out")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--precision", default="bf16", help="bf16 or int8")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require_checkpoint(args.model, "causal LM", CAUSAL_LM)  # a missing folder is not a Hub id to look up
    set_seed(0)  # LoRA's initial A: a resumed run continues the same run
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(open(args.text, encoding="utf-8").read(), return_tensors="pt").input_ids[0]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    training_args = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, save_steps=args.save_steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=not on_gpu, bf16=False,
        torch_compile=True, torch_compile_backend="stagehand",
    )
    # Before the Trainer wraps the model, on this rank's device: under torchrun `training_args.device` starts
    # torch.distributed, so the ranks of a node share one host store.
    rt = stagehand.offload(model, device=training_args.device, precision=args.precision)
    trainer = StagehandTrainer(model=model, args=training_args, train_dataset=Windows(ids, args.seq),
                               stagehand_options={} if on_gpu else {"inner": "eager"})  # Inductor is slow on a CPU
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(f"global step {trainer.state.global_step}; stagehand ran {rt.stats()['steps']} steps here, "
          f"streamed {rt.stats()['h2d_bytes'] / 1e6:,.1f} MB; compiled graphs {rt.stats()['compiled_graphs']}")

    adapter = os.path.join(args.out, "adapter")
    model.save_pretrained(adapter)  # peft: adapter_config.json + adapter_model.safetensors
    print(f"saved the adapter to {adapter}")
    rt.restore()  # plain nn.Linear modules again
    check_reload(model, args.model, adapter, Windows(ids, args.seq)[0]["input_ids"][None], dtype,
                 training_args.device)
    return trainer, rt


def check_reload(model, folder, adapter, probe, dtype, device):
    """The adapter in the plain library model: the same outputs as the trained model."""
    model.to(device).eval()
    probe = probe.to(device)
    with torch.no_grad():
        trained = model(input_ids=probe).logits
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
        again = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=probe).logits
    diff = (trained - again).abs().max().item()
    print(f"reloaded with PeftModel.from_pretrained: max |logits difference| = {diff:.3g}")
    torch.testing.assert_close(again, trained)
    return diff


if __name__ == "__main__":
    main()
