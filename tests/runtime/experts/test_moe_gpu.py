"""Streamed expert stacks on the GPU, compiled with Inductor: the same numbers as the plain model."""

from __future__ import annotations

import copy

import peft
import pytest
import torch

import torch_stagehand as stagehand

from _helpers import int8_reference, moe_inputs, rel_err
from test_moe import EXPERT_TARGETS, SLOW_LINK, _model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("lora_on", ["experts", "attention"])
@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_inductor_blocks_with_streamed_experts_train_as_the_plain_model(family, precision, lora_on):
    from torch_stagehand import kernels

    if lora_on == "attention" and precision == "bf16":
        pytest.skip("bf16 stacks are views of the slot either way")
    torch._dynamo.reset()
    # LoRA on the experts makes each stack dense (stack + delta); on attention only, an int8 stack is multiplied
    # from its bytes by the grouped kernel (or dequantize + grouped_mm: the autotuner's pick).
    config = peft.LoraConfig(r=4, target_modules=["o_proj"], init_lora_weights=False,
                             **({"target_parameters": EXPERT_TARGETS[family]} if lora_on == "experts" else {}))
    base = _model(family, torch.bfloat16)
    ref = peft.get_peft_model(int8_reference(base, "int8") if precision == "int8" else copy.deepcopy(base), config)
    model = peft.get_peft_model(base, config)
    model.load_state_dict(ref.state_dict(), strict=False)
    for name, p in ref.named_parameters():
        if p.requires_grad:
            model.get_parameter(name).data.copy_(p.data)
    ref32 = copy.deepcopy(ref).float().cuda().train()  # the same weights in fp32: what both bf16 runs approximate
    ref.cuda().train()
    model.train()
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rt = stagehand.offload(model, device="cuda", precision=precision, vram_budget="1GiB", verbose=False)
    ids = moe_inputs().cuda()
    want = ref(ids, labels=ids).loss
    want.backward()
    ref32(ids, labels=ids).loss.backward()
    compiled = stagehand.compile_blocks(model)
    for _ in range(2):  # the first step calibrates the plan, the second runs it
        model.zero_grad(set_to_none=True)
        got = compiled(ids, labels=ids).loss
        got.backward()
    assert abs(got.item() - want.item()) < 2e-2
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    exact = {n: p.grad for n, p in ref32.named_parameters() if p.grad is not None}
    assert lora_on == "attention" or any("experts" in n for n in grads)
    for name, p in model.named_parameters():
        if p.grad is not None:
            # Inductor's fusions round bf16 elsewhere than eager: as close to fp32 as the plain bf16 model is
            plain_error = rel_err(grads[name], exact[name])
            assert rel_err(p.grad, exact[name]) < 2 * plain_error + 1e-2, (name, plain_error)
    stats = rt.stats()
    assert stats["eager_linear_calls"] == 0
    if lora_on == "attention":  # the grouped GEMMs were tuned (forward and grad-input)
        tuned = {k[0] for k in kernels.tuning_log() if str(k[0]).startswith("grouped-")}
        assert {"grouped-8-out-int8", "grouped-8-in-int8"} <= tuned, tuned


@pytest.mark.parametrize("cache", [0, "64MiB"])
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_generation_reading_the_routed_experts_from_pinned_memory_gives_the_whole_block_tokens(precision, cache):
    plain = _model("qwen3_moe", torch.bfloat16)
    plain.config.use_cache = True
    whole, routed = copy.deepcopy(plain), copy.deepcopy(plain)
    rt_whole = stagehand.offload(whole, device="cuda", precision=precision, verbose=False,
                                 config=stagehand.Config(routed_experts_max_tokens=0))
    rt_routed = stagehand.offload(routed, device="cuda", precision=precision, verbose=False,
                                  config=stagehand.Config(expert_cache_bytes=cache))
    rt_routed.plan_driver.cost_model.h2d_bps = SLOW_LINK  # tiny blocks: make the routed copies pay
    prompt = moe_inputs().cuda()[:1, :2]  # 2 tokens x top-2 of 8 experts: the prompt reads its experts directly too
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0, use_cache=True)
    for _ in range(2):  # the second generation finds experts in the cache (the roomy one)
        with torch.inference_mode():
            a, b = whole.generate(prompt, **kw), routed.generate(prompt, **kw)
        assert torch.equal(a.sequences, b.sequences)
        for la, lb in zip(a.logits, b.logits):  # the same kernels on the same bytes
            torch.testing.assert_close(la, lb, rtol=0, atol=0)
    assert rt_routed.eager.direct_reads > 0 and rt_routed.stats()["h2d_bytes"] < rt_whole.stats()["h2d_bytes"]
    reads = rt_routed.stats()["routed_reads"]
    assert reads["whole_stacks"] == 0 and reads["expert_cache"]["prefetched"] > 0
    if cache:
        assert reads["expert_cache"]["hits"] > reads["expert_cache"]["misses"]
