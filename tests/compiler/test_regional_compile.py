"""A torch.compile per block (the documented `torch.compile(model)` on an offloaded model, `stagehand.compile_blocks`,
diffusers' `compile_repeated_blocks`, accelerate's regional compilation) through the backend: Dynamo traces one
block of each structure and every other block runs its graph
(a streamed Linear hands the op its block's token, a graph input, and its position, never a constant naming the
layer), with the plain model's numbers, in any precision map, across precision switches and in full fine-tuning."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import torch_stagehand as stagehand
from torch_stagehand.app.presets import tiny_flux, tiny_llama

from _helpers import first_tensor, rel_err


def _lora_qwen2(layers: int):
    import peft
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():  # LoRA B starts at zero: give its gradient something to carry
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model, torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_every_block_runs_the_graph_of_the_first_with_the_plain_numbers():
    model, ids = _lora_qwen2(6)
    plain = copy.deepcopy(model)
    ref = plain(input_ids=ids, labels=ids).loss
    ref.backward()
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    counters.clear()
    # A recompile limit below the number of blocks: every block still compiles (one graph serves all six).
    with torch._dynamo.config.patch(recompile_limit=3):
        stagehand.compile_blocks(model, options={"inner": "eager"})
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert torch.equal(loss, ref)
    grads, want = _lora_grads(model), _lora_grads(plain)
    assert grads.keys() == want.keys() and len(grads) == 24
    assert all(torch.equal(grads[n], want[n]) for n in grads)  # fp32, the same ATen ops: measured 0
    # Two Dynamo graphs for six blocks: block 0's input (the frozen embedding's output) does not require grad, the
    # others' do, and Dynamo guards on that flag; blocks 1-5 run one graph.
    assert _unique_graphs() == 2 and len(rt.graph_records) == 2
    stats = rt.stats()
    assert stats["eager_linear_calls"] == 0  # no block fell back to the eager op path
    assert "the compiled root is block 0" in " ".join(rt.graph_records[0].changes)
    assert [[s.kind for s in r.segments] for r in rt.graph_records] == [["block"], ["block"]]  # no glue units
    rt.close()


def _flux_lora_steps(steps: int = 2):
    """`steps` LoRA steps of a tiny Flux (3 double, 4 single blocks) compiled block by block: the last loss, the
    LoRA grads it left, and how many Dynamo graphs the run traced."""
    import peft

    model, inputs = tiny_flux(dtype=torch.float32, double=3, single=4)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))
    for name, p in model.named_parameters():  # LoRA B starts at zero: give its gradient something to carry
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(2))
    rt = stagehand.offload(model, device="cpu", precision="int8", verbose=False)
    torch._dynamo.reset()
    counters.clear()
    stagehand.compile_blocks(model, options={"inner": "eager"})
    for _ in range(steps):
        model.zero_grad()
        loss = first_tensor(model(**inputs)).square().mean()
        loss.backward()
    graphs = _unique_graphs()
    rt.close()
    return loss.detach(), _lora_grads(model), graphs


def test_a_run_after_the_first_traces_the_first_block_with_the_others(tmp_path, monkeypatch, caplog):
    """The first double block's residual stream (the frozen embeddings' output) needs no grad, the others' does:
    the first run traces it apart, and names the arguments beside its compile bundle; a later run gives them
    grad before Dynamo sees them and traces one graph per structure, with the same numbers. A hints file that
    cannot be read is ignored, with a warning that names it."""
    monkeypatch.setenv("STAGEHAND_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STAGEHAND_COMPILE_CACHE", "1")
    loss, grads, graphs = _flux_lora_steps()
    assert graphs == 3  # double block 0, double blocks 1-2, single blocks
    (hints,) = (tmp_path / "compile").glob("*.residual.json")
    import json

    assert json.loads(hints.read_text()) == {"base_model.model.transformer_blocks": ["hidden_states",
                                                                                   "encoder_hidden_states"]}
    again_loss, again_grads, again_graphs = _flux_lora_steps()
    assert again_graphs == 2
    assert torch.equal(again_loss, loss)  # the same ops on the same values: measured 0 (CPU, torch 2.13)
    assert again_grads.keys() == grads.keys() and all(torch.equal(again_grads[n], grads[n]) for n in grads)

    hints.write_text("{not json")
    with caplog.at_level("WARNING", logger="torch_stagehand.compiler"):
        _, _, corrupt_graphs = _flux_lora_steps(steps=1)
    assert corrupt_graphs == 3 and f"residual-stream hints {hints} ignored: unreadable" in caplog.text


def test_give_grad_reaches_the_named_arguments_by_position_or_keyword_and_leaves_the_rest():
    from torch_stagehand.compiler.residual_hints import give_grad, positional_names

    def forward(hidden_states, temb, encoder_hidden_states=None, ids=None):
        return hidden_states

    positional = positional_names(forward)
    assert positional == ["hidden_states", "temb", "encoder_hidden_states", "ids"]
    names = ["hidden_states", "encoder_hidden_states", "ids"]
    h, t, e, ids = torch.ones(2, 3), torch.ones(3), torch.ones(2, 3), torch.arange(3)
    args, kwargs = give_grad(positional, names, (h, t), {"encoder_hidden_states": e, "ids": ids})
    assert len(args) == 2 and set(kwargs) == {"encoder_hidden_states", "ids"}  # passed as they came
    assert args[0].requires_grad and kwargs["encoder_hidden_states"].requires_grad
    assert not args[1].requires_grad and kwargs["ids"] is ids  # not named / not floating: as they were
    assert not h.requires_grad and torch.equal(args[0], h)  # a new leaf; the caller's tensor unchanged
    # A later block's call, whose stream needs grad already: passed through as it is, `trains` never asked.
    asked = []
    again = give_grad(positional, names, args, kwargs, trains=lambda: asked.append(True) or True)
    assert again[0] is args and again[1] is kwargs and asked == []
    # A block with nothing that trains: left as it is.
    assert give_grad(positional, names, (h, t), {}, trains=lambda: False)[0][0] is h


def test_two_block_structures_are_traced_apart_and_match_the_whole_model_compile():
    """Flux: double and single blocks; the glue outside the blocks runs eagerly."""
    model, inputs = tiny_flux(dtype=torch.float32, double=3, single=4)
    whole = copy.deepcopy(model)
    rt_whole = stagehand.offload(whole, device="cpu", precision="int8", verbose=False)
    torch._dynamo.reset()
    want = first_tensor(torch.compile(whole, backend="stagehand", options={"inner": "eager"})(**inputs))
    rt = stagehand.offload(model, device="cpu", precision="int8", verbose=False)
    torch._dynamo.reset()
    counters.clear()
    stagehand.compile_blocks(model, options={"inner": "eager"})
    with torch.no_grad():
        got = first_tensor(model(**inputs))
    assert rel_err(got, want.detach()) < 1e-6  # measured 0 (CPU, torch 2.13)
    # Two traces for seven blocks, one per structure. The first single block's input (the double blocks' output)
    # and the others' (a slice of the previous single block's) differ in the batch stride alone, which addresses
    # nothing at batch 1: compile_blocks makes it canonical, so Dynamo does not trace the second one again.
    assert _unique_graphs() == 2 and len(rt.graph_records) == 2
    assert rt.stats()["eager_linear_calls"] == 0
    rt.close()
    rt_whole.close()


def test_a_mixed_map_and_a_switch_relink_variants_under_the_one_graph():
    """Blocks of one structure in different precisions run one Dynamo graph, each its own variant; a switch
    re-links variants and traces nothing."""
    model, ids = _lora_qwen2(4)
    whole = copy.deepcopy(model)
    mixed = {0: "int8", 1: "bf16", 2: "int8", 3: "bf16"}
    rt_whole = stagehand.offload(whole, device="cpu", precision=mixed, verbose=False)
    rt = stagehand.offload(model, device="cpu", precision=mixed, verbose=False)
    torch._dynamo.reset()
    compiled_whole = torch.compile(whole, backend="stagehand", options={"inner": "eager"})
    stagehand.compile_blocks(model, options={"inner": "eager"})
    for step, switch in enumerate([None, "int8", "bf16"]):
        if switch is not None:
            rt.set_precision(switch)
            rt_whole.set_precision(switch)
        counters.clear()
        want = compiled_whole(input_ids=ids, labels=ids).loss
        got = model(input_ids=ids, labels=ids).loss
        assert torch.equal(got, want), step
        if step:
            assert _unique_graphs() == 0  # a switch traces nothing: the units re-link
    assert len(rt.graph_records) == 2  # block 0 (its input needs no grad) and the others
    assert rt.stats()["eager_linear_calls"] == 0
    rt.close()
    rt_whole.close()


def test_full_fine_tuning_through_regional_compiles_trains_as_the_plain_model():
    model, inputs = tiny_llama(dtype=torch.float32, layers=3, batch=2, seq=16)
    model.requires_grad_(True)
    model.config.use_cache = False
    plain = copy.deepcopy(model)

    def train(m, forward, rt=None):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        if rt is not None:
            rt.attach(opt)
        losses = []
        for _ in range(3):
            loss = forward(**inputs, labels=inputs["input_ids"]).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    want = train(plain, plain)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    stagehand.compile_blocks(model, options={"inner": "eager"})
    got = train(model, model, rt)
    assert got == pytest.approx(want, rel=1e-5)  # measured within 2e-7 (the streamed weights step on the host)
    assert len(rt.graph_records) == 1 and rt.stats()["eager_linear_calls"] == 0
    rt.close()


def test_a_kv_cache_that_retraces_every_block_is_named():
    model, inputs = tiny_llama(dtype=torch.float32, layers=2)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    stagehand.compile_blocks(model, options={"inner": "eager"})
    with pytest.warns(stagehand.RegionalCompileWarning, match="LlamaForCausalLM's compiled call fills a KV cache"):
        with torch.no_grad():  # said at the first compiled call; correct all the same, a graph per block
            model(**inputs)
    assert len(rt.graph_records) == 2
    rt.close()


def test_the_models_own_checkpointing_moves_into_the_block_units():
    """Flux with diffusers' gradient checkpointing: a compiled call switches the flag off and the units recompute
    (one forward again in backward, inside the unit), with the checkpointed plain model's LoRA gradients."""
    import peft

    model, inputs = tiny_flux(dtype=torch.float32, double=2, single=2)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    model.get_base_model().enable_gradient_checkpointing()
    model.train()
    plain = copy.deepcopy(model)
    first_tensor(plain(**inputs)).square().mean().backward()
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    stagehand.compile_blocks(model, options={"inner": "eager"})
    first_tensor(model(**inputs)).square().mean().backward()
    assert model.get_base_model().gradient_checkpointing  # switched off for the compiled call, put back after it
    grads, want = _lora_grads(model), _lora_grads(plain)
    assert len(grads) == 24 and all(rel_err(grads[n], want[n]) < 1e-6 for n in grads)  # measured 0
    assert rt.stats()["recomputed_blocks"] == 4  # each block's forward ran once more, in its unit
    from torch_stagehand.compiler.variants import variant_cache

    # Compiled: per structure one forward variant (without grad) and its recompute's training variant: block 0's
    # stream (from embedders that train nothing) is made to need grad as every later block's does, and the
    # single blocks' inputs' batch strides are made canonical: one signature each.
    grad_modes = sorted(key[2] for key, info in variant_cache(rt).info.items()
                        if info["label"].startswith("block variant"))
    assert grad_modes == [False, False, True, True]
    whys = [info["why"] for info in variant_cache(rt).info.values() if info["label"].startswith("block variant")]
    assert whys.count("new structure") == 2  # each variant after a structure's first names what it differs in
    assert all(w == "new structure" or "input" in w or "grad mode" in w for w in whys)


def test_adapters_added_after_offload_compile_block_by_block():
    """A model offloaded first (built on meta and loaded from files, typically), then wrapped by peft: the blocks are
    found by the offloaded model's names, not the wrapper's."""
    import peft

    model, inputs = tiny_llama(dtype=torch.float32, layers=3, batch=1, seq=8)
    model.config.use_cache = False
    plain = copy.deepcopy(model)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(model, lora)
    plain = peft.get_peft_model(plain, lora)
    plain.load_state_dict(wrapped.state_dict())
    torch._dynamo.reset()
    stagehand.compile_blocks(wrapped, options={"inner": "eager"})
    with torch.no_grad():
        got, want = wrapped(**inputs).logits, plain(**inputs).logits
    assert rel_err(got, want) < 1e-6 and len(rt.graph_records) == 1  # measured 0
    assert rt.stats()["eager_linear_calls"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_on_the_gpu_with_inductor_blocks_compiled_one_by_one_train_as_the_whole_model(precision):
    """Inductor units, real streams and slots, a VRAM plan: the regional and the whole-model compile give the same
    loss and LoRA gradients over three steps (the plan, the precision and the compiled code are the same per block)."""
    import peft

    def run(regional: bool):
        model, inputs = tiny_flux(dtype=torch.bfloat16, double=3, single=6, image_tokens=64, text_tokens=16)
        model.requires_grad_(False)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(7))
        inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        rt = stagehand.offload(model, device="cuda", precision=precision, verbose=False)
        torch._dynamo.reset()
        forward = stagehand.compile_blocks(model) if regional else torch.compile(model, backend="stagehand")
        losses = []
        for _ in range(3):
            loss = first_tensor(forward(**inputs)).float().square().mean()
            loss.backward()
            losses.append(loss.item())
        grads = _lora_grads(model)
        stats, graphs = rt.stats(), len(rt.graph_records)
        rt.close()
        return losses, grads, stats, graphs

    whole_losses, whole_grads, _, _ = run(False)
    losses, grads, stats, graphs = run(True)
    assert graphs <= 4  # nine blocks, two kinds: each kind's first block apart at most (not a trace per block)
    assert losses == pytest.approx(whole_losses, rel=2e-3)  # Inductor fuses the glue differently: measured < 1e-3
    assert max(rel_err(grads[n], whole_grads[n]) for n in grads) < 2e-2
    assert stats["eager_linear_calls"] == 0 and stats["h2d_bytes"] > 0  # every block streamed through its unit


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("regional", [False, True])
def test_ddp_buckets_compile_their_pieces_on_fakes_and_match_the_plain_model(regional, monkeypatch):
    """DDPOptimizer splits the graph at its gradient buckets and hands the backend fake inputs: the block tokens
    are found by the streamed linears' module paths instead of by identity."""
    import torch.distributed as dist

    model, inputs = tiny_llama(dtype=torch.float32, layers=3, batch=1, seq=8)
    model.config.use_cache = False
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)  # small trainable parameters: buckets of a few hundred bytes split blocks
    plain = copy.deepcopy(model)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    monkeypatch.setattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 512)  # DDPOptimizer wants the first no larger
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        if regional:
            stagehand.compile_blocks(model, options={"inner": "eager"})
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
        forward = ddp if regional else torch.compile(ddp, backend="stagehand", options={"inner": "eager"})
        got = forward(**inputs).logits
    finally:
        dist.destroy_process_group()
    assert rel_err(got, plain(**inputs).logits) < 1e-6  # measured 0
    assert len(rt.graph_records) > (1 if regional else 0) and rt.stats()["eager_linear_calls"] == 0
    rt.close()


def test_full_fine_tuning_under_another_aot_backend_keeps_the_eager_ops_numbers():
    """Under `aot_eager` the streamed linear's autograd is traced with a functional token: the weight gradient is
    decided when the op runs, not from the token's value at trace time."""
    model, inputs = tiny_llama(dtype=torch.float32, layers=2, batch=1, seq=8)
    model.config.use_cache = False
    model.requires_grad_(True)
    plain = copy.deepcopy(model)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    got = torch.compile(model, backend="aot_eager")(**inputs, labels=inputs["input_ids"]).loss
    want = plain(**inputs, labels=inputs["input_ids"]).loss
    got.backward()
    want.backward()
    assert torch.equal(got, want)
    mine = dict(model.named_parameters())
    assert all(torch.equal(p.grad, mine[n].grad) for n, p in plain.named_parameters())  # measured 0
    rt.close()


def test_unit_strides_gives_size_one_dimensions_the_contiguous_stride_and_copies_nothing():
    from torch_stagehand.compiler.block_frames import unit_strides

    base = torch.randn(1, 40, 32, requires_grad=True)
    tail = base[:, 8:]  # [1, 32, 32] with batch stride 40 * 32
    got = unit_strides(tail)
    assert got.stride() == (32 * 32, 32, 1) and got.data_ptr() == tail.data_ptr() and torch.equal(got, tail)
    got.sum().backward()  # a view: the gradient reaches the base as the slice's would
    assert torch.equal(base.grad, torch.cat([torch.zeros(1, 8, 32), torch.ones(1, 32, 32)], dim=1))
    odd = torch.randn(4, 6).t()[:, None, :]  # [6, 1, 4]: a transpose, its size-1 dimension's stride 1
    assert unit_strides(odd).stride() == (1, 4 * 6, 6) and torch.equal(unit_strides(odd), odd)
    plain = torch.randn(2, 3)
    assert unit_strides(plain) is plain


def _default_path_first_step(layers: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The documented call on a LoRA Qwen2 of `layers` layers: offload, torch.compile(model), one training step.
    Dynamo's and the backend's one-time work of that step (counted, not timed), its loss and the plain model's."""
    model, ids = _lora_qwen2(layers)
    plain = copy.deepcopy(model)
    ref = plain(input_ids=ids, labels=ids).loss
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    work = {"frames": counters["stats"]["unique_graphs"], "ops_traced": counters["stats"]["calls_captured"],
            "units": rt.stats()["compiled_units"], "eager_linear_calls": rt.stats()["eager_linear_calls"]}
    rt.close()
    return work, loss.detach(), ref.detach()


def test_the_documented_call_traces_one_block_whatever_the_depth():
    """`torch.compile(model, backend="stagehand")` after offload: the first step's one-time work at 32 layers is
    at most twice that at 4 (measured: the same), with the plain model's loss."""
    shallow, loss4, ref4 = _default_path_first_step(4)
    deep, loss32, ref32 = _default_path_first_step(32)
    assert torch.equal(loss4, ref4) and torch.equal(loss32, ref32)  # fp32, the same ATen ops: measured 0
    for what in ("frames", "ops_traced", "units"):
        assert 0 < deep[what] <= 2 * shallow[what], (what, shallow, deep)
    assert shallow["eager_linear_calls"] == deep["eager_linear_calls"] == 0  # every block ran compiled


def test_a_training_call_fills_no_kv_cache_and_its_step_clock_covers_the_compiles():
    """A Llama whose config keeps `use_cache=True` (transformers' default), LoRA-trained through the documented
    call: the call is passed `use_cache=False` (else each block's layer index would trace it again), nothing is
    warned, the loss is the plain model's, and every unit compiles inside the step's forward phase (the printed
    first-step time is the whole first call)."""
    import warnings

    import peft

    from torch_stagehand.runtime.conductor.phases import Phase

    model, inputs = tiny_llama(dtype=torch.float32, layers=4)
    assert model.config.use_cache
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.train()
    plain = copy.deepcopy(model)
    ref = plain(**inputs, labels=inputs["input_ids"]).loss
    rt = stagehand.offload(model, device="cpu", verbose=False)
    phases_at_compile = []
    record = rt.record_compile
    rt.record_compile = lambda *a, **k: (phases_at_compile.append(rt.phases.phase), record(*a, **k))[1]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", stagehand.RegionalCompileWarning)
        out = compiled(**inputs, labels=inputs["input_ids"])
    out.loss.backward()
    assert torch.equal(out.loss, ref)
    assert out.past_key_values is None
    assert _unique_graphs() == 2  # block 0 (its input needs no grad) and blocks 1-3: not one per layer index
    assert phases_at_compile and set(phases_at_compile) == {Phase.FORWARD}
    rt.close()


def test_a_kv_cache_under_blocks_the_user_compiled_is_named():
    """Each block compiled by the user (regional compilation: the model's own call eager) in a call that fills a
    KV cache: the first block compiled under it says so."""
    model, inputs = tiny_llama(dtype=torch.float32, layers=2)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    for block in model.model.layers:
        block.compile(backend="stagehand", options={"inner": "eager"})
    with pytest.warns(stagehand.RegionalCompileWarning, match="LlamaForCausalLM's compiled call fills a KV cache"):
        with torch.no_grad():
            model(**inputs)
    rt.close()
