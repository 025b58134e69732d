"""A torch.compile per block (diffusers' `compile_repeated_blocks`, accelerate's regional compilation) through the
backend: each block is a graph of its own; the numbers are the plain model's; past Dynamo's recompile limit the
remaining blocks run eagerly, which the backend says before it happens, with the way out."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import torch_stagehand as stagehand


def _model(layers: int):
    import peft
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return model, torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))


def _regional_step(layers: int):
    model, ids = _model(layers)
    ref = copy.deepcopy(model)(input_ids=ids, labels=ids).loss
    rt = stagehand.offload(model, device="cpu")
    torch._dynamo.reset()
    for layer in model.base_model.model.model.layers:
        layer.compile(backend="stagehand", options={"inner": "eager"})
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return rt, loss, ref


def test_blocks_compiled_one_by_one_stream_in_their_graphs_with_the_plain_numbers():
    with warnings.catch_warnings():
        warnings.simplefilter("error", stagehand.RegionalCompileWarning)  # under the limit: nothing to say
        rt, loss, ref = _regional_step(4)
    assert torch.equal(loss, ref)
    assert rt.stats()["eager_linear_calls"] == 0 and len(rt.graph_records) == 4  # one graph per block


def test_more_blocks_than_the_recompile_limit_are_named_before_they_fall_back():
    with torch._dynamo.config.patch(recompile_limit=3):
        with pytest.warns(stagehand.RegionalCompileWarning, match=r"6 blocks .*recompile_limit \(3\)"):
            rt, loss, ref = _regional_step(6)
    assert torch.equal(loss, ref)  # correct: the last blocks ran the eager op path
    assert rt.stats()["eager_linear_calls"] > 0
    with torch._dynamo.config.patch(recompile_limit=6), warnings.catch_warnings():
        warnings.simplefilter("error", stagehand.RegionalCompileWarning)
        rt, loss, ref = _regional_step(6)  # the limit raised to the number of blocks: every block compiles
    assert torch.equal(loss, ref) and rt.stats()["eager_linear_calls"] == 0
