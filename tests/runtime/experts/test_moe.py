"""Mixture-of-experts models stream their expert stacks (transformers 5's fused 3-D experts).

Tiny random configs of five families, each against the plain model with the same weights: Qwen3-MoE,
Qwen2-MoE (shared expert), Mixtral, gpt-oss (transposed stacks with biases, its own gate) and a
DeepSeek-V3-style block (MLA attention, shared + routed experts, grouped routing).
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch
import transformers

import torch_stagehand as stagehand
from torch_stagehand.runtime.blocks import find_blocks, streamed_layers
from torch_stagehand.runtime.experts.stacks import StreamedExpertsTrainError
from torch_stagehand.runtime.experts.lora import StreamedLoraMergeError
from torch_stagehand.runtime.streamed import HostMasterParameter

from _helpers import int8_reference, moe_config, moe_inputs, moe_lora, rel_err

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles new models of the same classes: past Dynamo's recompile limit a frame would run eagerly.
    torch._dynamo.reset()
    yield


def _model(family: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(family)).to(dtype)
    model.requires_grad_(False)
    return model.eval()


def _compiled(model):
    return torch.compile(model, backend="stagehand", options={"inner": "eager"})


def _train_against_the_plain_model(plain, model):
    """Offload `model`, one training step of each (the offloaded one compiled, its saved tensors recorded), and
    the same gradients (fp32: the same ops). Returns the runtime, the saved tensors and the plain gradients."""
    rt = stagehand.offload(model, device="cpu", verbose=False)
    ids = moe_inputs()
    plain(ids, labels=ids).loss.backward()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = _compiled(model)(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and got.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(got[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)
    return rt, saved, grads


@pytest.mark.parametrize("family", FAMILIES)
def test_the_expert_stacks_stream_and_hold_nearly_all_of_a_blocks_bytes(family):
    model = _model(family)
    blocks = find_blocks(model)
    specs = streamed_layers(model, blocks)
    stacks = [s for s in specs if s.experts]
    assert stacks and all(s.experts == 8 and s.weight.dim() == 3 for s in stacks)
    for b, fqn in enumerate(blocks):
        block_bytes = sum(p.numel() * p.element_size() for p in model.get_submodule(fqn).parameters())
        streamed = sum(s.weight.numel() * s.weight.element_size() for s in specs if s.block == b)
        assert streamed / block_bytes >= 0.9, (fqn, streamed / block_bytes)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    assert rt.stats()["offload"]["expert_stacks"] == len(stacks)
    # The module keeps its parameters (state_dict is real) as host masters: nothing of the stacks went anywhere.
    experts = stacks[0].module
    assert all(isinstance(experts._parameters[s.param], HostMasterParameter) for s in stacks if s.module is experts)


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_match_the_plain_model_eagerly_and_compiled(family):
    model = _model(family)
    plain = copy.deepcopy(model)
    ids = moe_inputs()
    stagehand.offload(model, device="cpu", verbose=False)
    with torch.no_grad():
        want = plain(ids).logits
        assert torch.equal(model(ids).logits, want)  # the eager op path
        assert torch.equal(_compiled(model)(ids).logits, want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_through_frozen_streamed_experts_match_the_plain_model(family, checkpointing):
    base = _model(family)
    plain = moe_lora(copy.deepcopy(base))
    model = moe_lora(base)
    model.load_state_dict(plain.state_dict())
    for m in (plain, model):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rt, saved, _ = _train_against_the_plain_model(plain, model)
    # The backward read the stacks from its own fetch: nothing saved shares a slot's or the host store's bytes.
    forbidden = {s.buf.untyped_storage().data_ptr() for s in rt.pool.slots}
    forbidden |= {rt.store.buffer(b, "bf16").untyped_storage().data_ptr() for b in range(len(rt.blocks))}
    assert saved and not [t for t in saved if t.untyped_storage().data_ptr() in forbidden]
    assert rt.stats()["eager_linear_calls"] == 0


def test_blocks_compiled_one_by_one_stream_their_experts_as_the_whole_model_compile():
    base = _model("qwen2_moe")
    plain = moe_lora(copy.deepcopy(base))
    model = moe_lora(base)
    model.load_state_dict(plain.state_dict())
    plain.train(), model.train()
    rt = stagehand.offload(model, device="cpu", verbose=False)
    ids = moe_inputs()
    plain(ids, labels=ids).loss.backward()
    stagehand.compile_blocks(model, options={"inner": "eager"})(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert rt.stats()["eager_linear_calls"] == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_int8_experts_compute_the_dequantized_stacks(family):
    base = _model(family, torch.bfloat16)
    ref = moe_lora(int8_reference(base, "int8"))
    model = moe_lora(base)
    model.load_state_dict(ref.state_dict(), strict=False)
    for name, p in ref.named_parameters():
        if "lora_" in name:
            model.get_parameter(name).data.copy_(p.data)
    stagehand.offload(model, device="cpu", precision="int8", verbose=False)
    ids = moe_inputs()
    want = ref(ids, labels=ids).loss
    want.backward()
    got = _compiled(model)(ids, labels=ids).loss
    got.backward()
    assert abs(got.item() - want.item()) < 2e-2
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert rel_err(p.grad, grads[name]) < 5e-2, name


def test_a_stack_that_requires_grad_is_refused_in_a_training_forward_and_named():
    model = _model("qwen3_moe")
    model.model.layers[1].mlp.experts.down_proj.requires_grad_(True)
    stagehand.offload(model, device="cpu", verbose=False)
    with pytest.raises(StreamedExpertsTrainError, match=r"model\.layers\.1\.mlp\.experts\.down_proj"):
        model(moe_inputs())
    with torch.no_grad():  # inference reads it
        model(moe_inputs())
    # The flag is followed (after offload the attribute reads the stream: the parameter is named_parameters'):
    dict(model.named_parameters())["model.layers.1.mlp.experts.down_proj"].requires_grad_(False)
    model(moe_inputs())


def test_restore_gives_back_the_plain_expert_modules_with_their_values():
    model = _model("mixtral")
    plain = copy.deepcopy(model)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    rt.restore()
    experts = model.model.layers[0].mlp.experts
    assert type(experts) is type(plain.model.layers[0].mlp.experts)
    assert isinstance(experts.gate_up_proj, torch.nn.Parameter)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


EXPERT_TARGETS = {"qwen3_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                  "gpt_oss": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


@pytest.mark.parametrize("family", sorted(EXPERT_TARGETS))
def test_peft_target_parameters_on_the_experts_train_as_the_plain_peft_model(family):
    config = peft.LoraConfig(r=4, target_modules=["o_proj"], target_parameters=EXPERT_TARGETS[family],
                             init_lora_weights=False)
    base = _model(family)
    plain = peft.get_peft_model(copy.deepcopy(base), config)
    model = peft.get_peft_model(base, config)
    model.load_state_dict(plain.state_dict())
    plain.train(), model.train()
    rt, saved, grads = _train_against_the_plain_model(plain, model)
    assert any("experts" in n for n in grads)
    # Neither the stack nor the adapted stack (its size) is kept for the backward.
    stack_numels = {s.weight.numel() for s in rt.layers if s.experts}
    assert saved and not [t for t in saved if t.numel() in stack_numels]
    # The eager path (no compile) reads the same adapted stacks.
    ids = moe_inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-6)
    with pytest.raises(StreamedLoraMergeError, match="can not be merged"):
        model.merge_adapter()


def test_files_that_do_not_hold_fused_stacks_are_refused_naming_the_stack(tmp_path):
    from torch_stagehand.runtime.slab.builder import build_slab_from_module
    from torch_stagehand.runtime.slab.errors import SlabLayerNotFoundError

    model = _model("qwen3_moe", torch.bfloat16)
    model.save_pretrained(tmp_path / "ckpt")  # transformers writes the experts one by one
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(model.config).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"no model\.layers\.0\.mlp\.experts\.gate_up_proj \(the fused 8-expert"):
        stagehand.offload(meta, device="cpu", checkpoint=str(tmp_path / "ckpt"), verbose=False)
    built = build_slab_from_module(model, str(tmp_path), "moe", "moe", include_prefixes=("model.layers.",),
                                   print_report=False)
    with pytest.raises(SlabLayerNotFoundError, match=r"expert stack model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        stagehand.offload(model, device="cpu", precision="int8", slab=built.manifest_path, verbose=False)
    assert not any(type(m).__name__.startswith("Streamed") for m in model.modules())  # offload put it back


SLOW_LINK = 1e7  # bytes/s: a link slow enough that routed copies of these tiny blocks pay


def _generate_kw(tokens: int = 6) -> dict:
    return dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0, use_cache=True)  # one new token a forward


def _same_generation(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences)
    for la, lb in zip(a.logits, b.logits):
        assert torch.equal(la, lb)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_generation_reading_only_the_routed_experts_gives_the_whole_block_numbers(family, precision):
    plain = _model(family)
    whole, routed = copy.deepcopy(plain), copy.deepcopy(plain)
    for m in (plain, whole, routed):
        m.config.use_cache = True
    rt_whole = stagehand.offload(whole, device="cpu", precision=precision, verbose=False,
                                 config=stagehand.Config(routed_experts_max_tokens=0))
    # The cache at its floor (two blocks' picks): entries are evicted and taken again all the time.
    rt_routed = stagehand.offload(routed, device="cpu", precision=precision, verbose=False,
                                  config=stagehand.Config(expert_cache_bytes=0))
    rt_routed.plan_driver.cost_model.h2d_bps = SLOW_LINK
    kw = _generate_kw()
    for prompt in (moe_inputs()[:1, :2], moe_inputs()[:1]):  # a 2-token prompt (2 x top-2 of 8 experts), a 12-token one
        with torch.no_grad():
            a, b = whole.generate(prompt, **kw), routed.generate(prompt, **kw)
            ref = plain.generate(prompt, **kw) if precision == "bf16" else a
        _same_generation(a, b)
        assert torch.equal(ref.sequences, b.sequences)
    # The calls read their layers and routed experts directly, and moved less.
    assert rt_routed.eager.direct_reads > 0 and rt_whole.eager.direct_reads == 0
    assert rt_routed.stats()["h2d_bytes"] < rt_whole.stats()["h2d_bytes"]
    cache = rt_routed.stats()["routed_reads"]["expert_cache"]
    # The floor: 2 tokens' picks twice (top-2 of 8 experts): 8 entries. The 12-token prompt's forward picks
    # more than half of that in a block: it read those blocks whole; the one-token forwards went routed.
    assert cache["misses"] > 0 and cache["entries"] == 8 and rt_routed.eager.whole_stacks > 0


def test_the_cost_model_reads_the_whole_block_where_the_routed_copies_cost_more():
    plain = _model("qwen3_moe")
    model = copy.deepcopy(plain)
    plain.config.use_cache = model.config.use_cache = True
    rt = stagehand.offload(model, device="cpu", verbose=False)
    # The default 20 GB/s link: a tiny block's copy costs less than a few copies' fixed cost (COPY_SECONDS).
    with torch.no_grad():
        _same_generation(model.generate(moe_inputs()[:1, :2], **_generate_kw(3)),
                         plain.generate(moe_inputs()[:1, :2], **_generate_kw(3)))
    reads = rt.stats()["routed_reads"]
    assert reads["whole_stacks"] > 0 and reads["expert_cache"]["misses"] == 0
    rt.plan_driver.cost_model.h2d_bps = SLOW_LINK  # now the bytes dominate: routed
    with torch.no_grad():
        model.generate(moe_inputs()[:1, :2], **_generate_kw(3))
    assert rt.stats()["routed_reads"]["expert_cache"]["misses"] > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_the_expert_cache_keeps_experts_between_tokens_and_prefetches_from_the_next_router(family):
    plain = _model(family)
    model = copy.deepcopy(plain)
    plain.config.use_cache = model.config.use_cache = True
    rt = stagehand.offload(model, device="cpu", precision="int8", verbose=False,
                           config=stagehand.Config(expert_cache_bytes="1MiB"))
    rt.plan_driver.cost_model.h2d_bps = SLOW_LINK
    whole = copy.deepcopy(plain)
    stagehand.offload(whole, device="cpu", precision="int8", verbose=False,
                      config=stagehand.Config(routed_experts_max_tokens=0))
    prompt = moe_inputs()[:1, :1]
    with torch.no_grad():
        _same_generation(model.generate(prompt, **_generate_kw(8)), whole.generate(prompt, **_generate_kw(8)))
        first = dict(rt.stats()["routed_reads"]["expert_cache"])
        _same_generation(model.generate(prompt, **_generate_kw(8)), whole.generate(prompt, **_generate_kw(8)))
    cache = rt.stats()["routed_reads"]["expert_cache"]
    blocks = len(rt.blocks)
    assert cache["entries"] >= blocks * 8  # room for every expert of these tiny blocks: nothing evicted
    # The second generation found every expert it picked: each (block, expert) was copied once in all.
    assert cache["misses"] + cache["prefetched"] <= blocks * 8
    assert cache["hits"] > first["hits"] > 0
    # The next block's router guessed from this block's hidden states: experts were copied before their block
    # asked, and some of the guesses were what the block then picked.
    assert cache["prefetched"] > 0 and cache["prefetch_hits"] > 0


def test_fp8_stacks_compiled_compute_what_the_eager_op_computes():
    model = _model("qwen3_moe", torch.bfloat16)
    plain = copy.deepcopy(model)
    config = stagehand.Config()
    config.selective_precision.fp8_emulate = True  # no FP8 tensor cores on this machine: the stacks dequantize anyway
    stagehand.offload(model, device="cpu", precision="fp8", config=config, verbose=False)
    ids = moe_inputs()
    with torch.no_grad():
        eager, compiled, want = model(ids).logits, _compiled(model)(ids).logits, plain(ids).logits
    assert torch.equal(compiled, eager)
    assert rel_err(eager, want) < 0.08  # E4M3 per row on a tiny random model: measured 0.040


def test_a_3d_parameter_of_a_module_that_counts_no_experts_is_not_a_stack():
    from torch_stagehand.runtime.blocks import expert_stacks

    class Projection(torch.nn.Module):  # Funnel's r_kernel: [d_model, heads, d_head]
        def __init__(self):
            super().__init__()
            self.r_kernel = torch.nn.Parameter(torch.randn(16, 4, 4))

    class Experts(Projection):
        num_experts = 16

    assert expert_stacks(Projection()) == [] and expert_stacks(torch.nn.Conv1d(4, 6, 3)) == []
    assert [name for name, _ in expert_stacks(Experts())] == ["r_kernel"]


def test_a_stack_can_not_be_set_to_none_and_restore_still_gives_it_back():
    model = _model("qwen3_moe")
    plain = copy.deepcopy(model)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj streams"):
        model.model.layers[0].mlp.experts.gate_up_proj = None
    rt.restore()
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, plain.model.layers[0].mlp.experts.gate_up_proj)


def test_a_looped_experts_implementation_reads_each_stack_once_a_forward_under_inference_mode(monkeypatch):
    model = _model("qwen3_moe")
    model.set_experts_implementation("eager")  # a loop over the routed experts: `self.gate_up_proj[e]` each
    plain = copy.deepcopy(model)
    model.config.use_cache = plain.config.use_cache = True
    rt = stagehand.offload(model, device="cpu", verbose=False)
    rt.plan_driver.cost_model.h2d_bps = SLOW_LINK  # routed reads pay
    waits = []  # the router's choice read on the host: once per experts module and forward, not per stack
    unique = torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **k: waits.append(1) or unique(*a, **k))
    prompt = moe_inputs()[:1, :1]  # one token a forward: 2 of 8 experts, read directly
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=True)
    with torch.inference_mode():  # the direct reads' buffers are made here ...
        assert torch.equal(model.generate(prompt, **kw), plain.generate(prompt, **kw))
    with torch.no_grad():  # ... and written outside it
        assert torch.equal(model.generate(prompt, **kw), plain.generate(prompt, **kw))
    # 2 generations x 4 forwards x 3 blocks x (4 Linears + 2 stacks, each stack once a forward)
    assert rt.eager.direct_reads == 2 * 4 * 3 * 6
    assert len(waits) == 2 * 4 * 3


def test_two_adapters_on_the_stacks_train_as_peft_and_keep_no_adapted_stack():
    def config():
        return peft.LoraConfig(r=4, target_modules=["o_proj"], target_parameters=EXPERT_TARGETS["qwen3_moe"],
                               init_lora_weights=False)

    base = _model("qwen3_moe")
    plain = peft.get_peft_model(copy.deepcopy(base), config())
    model = peft.get_peft_model(base, config())
    for m in (plain, model):
        m.add_adapter("second", config())
    model.load_state_dict(plain.state_dict())
    for m in (plain, model):
        m.base_model.set_adapter(["default", "second"])
        m.train()
    rt, saved, grads = _train_against_the_plain_model(plain, model)  # peft sums the deltas: the same update
    assert any("lora_A.second" in n and "experts" in n for n in grads)
    stack_numels = {s.weight.numel() for s in rt.layers if s.experts}
    assert not [t for t in saved if t.numel() in stack_numels]


def test_explain_and_the_schedule_show_each_blocks_expert_bytes():
    model = _model("mixtral")
    rt = stagehand.offload(model, device="cpu", precision={0: "int8"}, verbose=False)
    report = stagehand.explain(model, moe_inputs())
    stacks = {b: sum(s.weight.numel() * s.weight.element_size() for s in rt.layers if s.experts and s.block == b)
              for b in range(3)}
    assert report.expert_bytes[1] == stacks[1]  # bf16 (here fp32): the stacks' own bytes
    assert stacks[0] // 4 < report.expert_bytes[0] < stacks[0] // 3  # int8: a byte a weight and a scale a row
    table = report.plan_table()
    assert "of which experts MiB" in table and f"{stacks[1] / 2**20:.3f}" in table


def test_a_full_expert_cache_gives_up_the_entries_of_the_block_that_runs_furthest_ahead():
    from collections import OrderedDict
    from types import SimpleNamespace

    from torch_stagehand.runtime.experts.cache import ExpertCache, _Pool

    cache = ExpertCache(None, [], SimpleNamespace(blocks=[None] * 4), None, None, first_layer={}, precision=dict,
                        device=torch.device("cpu"), capacity_bytes=0)
    pool = _Pool([], [])
    for entry, (block, expert) in enumerate([(0, 5), (1, 2), (1, 7), (2, 3), (3, 1)]):
        pool.where[(block, expert)] = entry
        pool.order.setdefault(block, OrderedDict())[expert] = None
    # Loading block 2: block 1 ran just before, so it runs again last: its oldest expert goes first.
    assert cache._take(pool, set(), 2) == 1 and (1, 2) not in pool.where
    # Its other expert is read by this forward (kept): then block 0, the next furthest ahead.
    assert cache._take(pool, {(1, 7)}, 2) == 0
    # Loading block 0 (the next token's first): block 3 is the furthest ahead of it now.
    assert cache._take(pool, {(1, 7)}, 0) == 4
    assert cache._take(pool, set(), 0) == 3 and cache._take(pool, set(), 0) == 2  # block 2, then 1's
    with pytest.raises(RuntimeError, match="all in use"):
        pool.where[(0, 1)] = 9
        pool.order[0] = OrderedDict({1: None})
        cache._take(pool, {(0, 1)}, 0)


def test_the_expert_cache_forgets_a_block_whose_weights_were_loaded_since():
    plain = _model("qwen3_moe")
    other = _model("qwen3_moe", seed=5)
    model, whole = copy.deepcopy(plain), copy.deepcopy(other)
    for m in (model, whole):
        m.config.use_cache = True
    rt = stagehand.offload(model, device="cpu", precision="int8", verbose=False,
                           config=stagehand.Config(expert_cache_bytes="1MiB"))
    rt.plan_driver.cost_model.h2d_bps = SLOW_LINK
    stagehand.offload(whole, device="cpu", precision="int8", verbose=False,
                      config=stagehand.Config(routed_experts_max_tokens=0))
    prompt = moe_inputs()[:1, :1]
    with torch.no_grad():
        model.generate(prompt, **_generate_kw(4))  # fills the cache with the first weights' experts
        model.load_state_dict(other.state_dict())
        _same_generation(model.generate(prompt, **_generate_kw(4)), whole.generate(prompt, **_generate_kw(4)))


def test_blocks_of_two_precisions_share_the_expert_cache_and_a_precision_change_gives_a_pool_up():
    model = _model("qwen3_moe")
    model.config.use_cache = True
    rt = stagehand.offload(model, device="cpu", precision={0: "bf16", 1: "int8", 2: "bf16"}, verbose=False,
                           config=stagehand.Config(expert_cache_bytes="1MiB"))
    rt.plan_driver.cost_model.h2d_bps = SLOW_LINK
    with torch.no_grad():
        model.generate(moe_inputs()[:1, :1], **_generate_kw(3))
    pools = list(rt.eager.cache._pools.values())
    first = sum(t.nbytes for t in (*pools[0].weights, *pools[0].scales) if t is not None)
    # One pool per layout, sharing the one budget: the first took it, the second only its floor (2 x 2 x top-2).
    assert len(pools) == 2 and first <= 2**20 and len(pools[1].weights[0]) == 8
    rt.set_precision("int8")
    with torch.no_grad():
        model.generate(moe_inputs()[:1, :1], **_generate_kw(3))
    assert len(rt.eager.cache._pools) == 1  # the bf16 layout's pool was given up


def test_an_expert_index_of_minus_one_from_the_router_does_not_cut_the_picks_short():
    model = _model("qwen3_moe")
    rt = stagehand.offload(model, device="cpu", verbose=False)
    memo = {("hidden",): torch.randn(2, 64)}
    picked = rt.eager._picked(0, torch.tensor([[-1, 3], [5, 2]]), memo)
    assert picked == [-1, 2, 3, 5] and -1 not in memo[("guess",)][1]
