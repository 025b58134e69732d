"""Write a tiny random-init checkpoint folder to try the recipes on without a download.

    python examples/make_tiny_checkpoint.py llama tiny-llama     # config, safetensors weights, a BPE tokenizer
    python examples/make_tiny_checkpoint.py qwen3_moe tiny-moe   # a mixture-of-experts LM (its experts stream)
    python examples/make_tiny_checkpoint.py flux tiny-flux       # a diffusers transformer/ subfolder
    python examples/lora_causal_lm.py tiny-llama --steps 5
    python examples/lora_flux.py tiny-flux --steps 5

The folders are laid out as `from_pretrained` reads a real one (a Hub snapshot); only the sizes differ.
The tokenizer is a byte-level BPE of 300 tokens trained here on the repository's README.
"""

import argparse
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def save_tiny_llama(folder, layers=2, hidden=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = save_tokenizer(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(folder)


def save_tiny_qwen3_moe(folder, layers=2, hidden=64):
    """A mixture-of-experts LM (8 experts, top-2): transformers saves its experts one by one and fuses them
    into 3-D stacks when it loads them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    vocab = save_tokenizer(folder)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)


def save_tokenizer(folder) -> int:
    """A byte-level BPE of 300 tokens trained on the README, saved in `folder`; returns its vocabulary size."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(os.path.join(HERE, "..", "README.md"), encoding="utf-8") as f:
        tok.train_from_iterator([f.read()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return len(fast)


def save_tiny_flux(folder, double=2, single=2):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=double, num_single_layers=single,
                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                           pooled_projection_dim=32, guidance_embeds=True,
                           axes_dims_rope=(4, 6, 6)).save_pretrained(os.path.join(folder, "transformer"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    makers = {"llama": save_tiny_llama, "qwen3_moe": save_tiny_qwen3_moe, "flux": save_tiny_flux}
    p.add_argument("kind", choices=list(makers))
    p.add_argument("folder")
    args = p.parse_args(argv)
    makers[args.kind](args.folder)
    print(f"wrote a tiny {args.kind} checkpoint to {args.folder}")


if __name__ == "__main__":
    main()
