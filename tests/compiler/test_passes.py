"""Each compiler pass on its own, on a hand-made or captured graph (torch_tensorrt's lowering-pass test style).

A captured graph is what Dynamo hands the backend for the offloaded toy model
(caught by a recording backend); each test runs ONE pass on it, asserts the
ops it must add or remove and, where the pass keeps semantics, equal numbers.
The last tests pin the pieces around the passes: the ordered lists, the
StreamingRuntime protocol, the variant cache's lifetime, the joint passes'
source-hashed cache uuid, and explain's list of the passes that ran.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx

import torch_stagehand as stagehand
from torch_stagehand.compiler import block_frames, passes, source_hash
from torch_stagehand.compiler.context import BackendOptions, CompileContext, VariantContext
from torch_stagehand.compiler.graph_nodes import is_streamed_linear, streamed_arg, token_owners
from torch_stagehand.compiler.inner import JointPasses
from torch_stagehand.compiler.interface import StreamingRuntime
from torch_stagehand.compiler.passes.rewrite_linear import BLOCK_TOK, PREV_TOK, WEIGHTS
from torch_stagehand.compiler.passes.schedule_forward import TOKEN_INPUTS
from torch_stagehand.compiler.units import BlockUnit, GlueUnit
from torch_stagehand.compiler.variants import variant_cache
from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.conductor.fetch_order import edge_token
from torch_stagehand.runtime.ops import SCHEDULE_OPS
from torch_stagehand.runtime.device.slots import SlotState

from _helpers import assert_exact, toy

OPS = SCHEDULE_OPS


def _count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.fixture
def captured():
    """An offloaded 3-block toy model, Dynamo's graph of it, its example inputs and the plain output."""
    model, x = toy(n=3)
    plain = copy.deepcopy(model)
    rt = stagehand.offload(model, device="cpu")
    block_frames.frames_of(rt).remove()  # the blocks inlined, as one graph: every pass sees all three
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=recording_backend)(x)
        expected = plain(x)
    gm, inputs = graphs[0]
    ctx = CompileContext(rt, BackendOptions("eager"), variant_cache(rt), passes.VARIANT_PASSES, passes.JOINT_PASSES,
                         tokens=token_owners(gm, inputs))
    yield rt, gm, inputs, expected, ctx
    rt.close()


def _run(gm, inputs):
    with torch.no_grad():
        out = gm(*inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _block_template(rt, gm, inputs, ctx, block: int):
    """Run the graph passes up to split_segments; return block `block`'s submodule and the inputs it got."""
    outer = ctx.run(passes.GRAPH_PASSES[:-1], gm)  # up to split_segments
    seg = next(s for s in ctx.segments if s.block == block)
    template = outer.get_submodule(seg.name)
    seen = []
    handle = template.register_forward_pre_hook(lambda _m, args: seen.append(args))
    _run(outer, inputs)
    handle.remove()
    return copy.deepcopy(template), seen[0]


def test_annotate_blocks_tags_every_block_node_and_keeps_numbers(captured):
    rt, gm, inputs, expected, ctx = captured
    assert "stagehand_block" not in next(n for n in gm.graph.nodes if is_streamed_linear(n)).meta
    gm = ctx.run([passes.annotate_blocks], gm)
    linears = [n for n in gm.graph.nodes if is_streamed_linear(n)]
    assert len(linears) == 6  # up and down of three blocks; embed and head are not streamed
    for node in linears:
        assert node.meta["stagehand_block"] == rt.layers[node.meta["stagehand_layer"]].block
    norms = [n for n in gm.graph.nodes if "layer_norm" in str(n.target)]
    assert [n.meta["stagehand_block"] for n in norms] == [0, 1, 2]
    assert gm.graph.find_nodes(op="output")[0].meta["stagehand_block"] is None
    assert [r.name for r in ctx.passes_ran] == ["annotate_blocks"] and "6 streamed linears" in ctx.passes_ran[0].notes[0]
    assert_exact(_run(gm, inputs), expected)  # measured 0 (CPU, torch 2.13, 3 seeds): the same ops run


def test_annotate_blocks_refuses_a_layer_of_another_runtime(captured):
    rt, gm, _inputs, _expected, ctx = captured
    other_model, _ = toy(n=2)
    other = stagehand.offload(other_model, device="cpu")
    node = next(n for n in gm.graph.nodes if is_streamed_linear(n))
    ctx.tokens[streamed_arg(node, "block_tok").name] = (other, 0)  # the graph's token input names the other model
    with pytest.raises(RuntimeError, match="two different offloaded models"):
        ctx.run([passes.annotate_blocks], gm)
    other.close()


def test_annotate_blocks_refuses_a_streamed_linear_without_a_block_token(captured):
    rt, gm, _inputs, _expected, ctx = captured
    node = next(n for n in gm.graph.nodes if is_streamed_linear(n))
    ctx.tokens.pop(streamed_arg(node, "block_tok").name)
    with pytest.raises(RuntimeError, match=f"streamed linear {node.name} takes .* not a block token"):
        ctx.run([passes.annotate_blocks], gm)


def test_assign_segments_records_segments_and_their_dag(captured):
    rt, gm, inputs, expected, ctx = captured
    gm = ctx.run([passes.annotate_blocks], gm)
    nodes_before = [n.name for n in gm.graph.nodes]
    gm = ctx.run([passes.assign_segments], gm)
    assert [n.name for n in gm.graph.nodes] == nodes_before  # the graph is unchanged
    assert [s.block for s in ctx.segments] == [None, 0, 1, 2, None]
    assert sorted(ctx.dag.edges) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [ctx.dag.nodes[i]["streamed"] for i in range(5)] == [0, 2, 2, 2, 0]
    assert all("stagehand_segment" in n.meta for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
    assert "5 segments: 3 block, 2 glue" in ctx.passes_ran[-1].notes[0]


def test_split_segments_calls_one_submodule_per_segment_and_keeps_numbers(captured):
    rt, gm, inputs, expected, ctx = captured
    gm = ctx.run([passes.annotate_blocks, passes.assign_segments], gm)
    outer = ctx.run([passes.split_segments], gm)
    calls = [n.target for n in outer.graph.nodes if n.op == "call_module"]
    assert calls == [f"submod_{i}" for i in range(5)]
    assert not [n for n in outer.graph.nodes if is_streamed_linear(n)]  # they all moved into the submodules
    assert sum(is_streamed_linear(n) for n in outer.get_submodule("submod_2").graph.nodes) == 2
    assert_exact(_run(outer, inputs), expected)  # measured 0


def test_link_units_makes_units_and_threads_tokens(captured):
    rt, gm, inputs, expected, ctx = captured
    gm = ctx.run([passes.annotate_blocks, passes.assign_segments, passes.split_segments], gm)
    outer = ctx.run([passes.link_units], gm)
    units = [type(outer.get_submodule(n.target)) for n in outer.graph.nodes if n.op == "call_module"]
    assert units == [GlueUnit, BlockUnit, BlockUnit, BlockUnit, GlueUnit]
    # Only the first block is prefetched by the outer graph; the others by the unit before them.
    assert _count(outer, OPS["prefetch"]) == 1
    # Each block unit gets the graph's own token input for its block (no constant names a block); the ends of
    # the graph ask for their neighbour at each call.
    assert not [n for n in outer.graph.nodes if n.op == "get_attr"]
    token_inputs = {name: block for name, (_rt, block) in ctx.tokens.items()}
    block_calls = [n for n in outer.graph.nodes if n.op == "call_module" and n.target.startswith("block_")]
    assert [token_inputs[c.args[-3].name] for c in block_calls] == [0, 1, 2]
    assert [token_inputs[block_calls[0].args[-2].name], token_inputs[block_calls[1].args[-1].name]] == [1, 0]
    edges = [n for n in outer.graph.nodes if n.target is edge_token]
    assert [(token_inputs[e.args[0].name], e.args[1]) for e in edges] == [(0, -1), (2, 1)]
    assert block_calls[0].args[-1] is edges[0] and block_calls[2].args[-2] is edges[1]
    assert edge_token(rt.block_tokens[2], 1, [rt.block_tokens[b] for b in range(3)]) is rt.no_block_token
    assert edge_token(rt.block_tokens[1], 1, [rt.block_tokens[1]]) is rt.block_tokens[2]  # a graph of one block
    assert block_calls[1].args[-4].target is operator.getitem and block_calls[1].args[-4].args[0] is block_calls[0]
    assert len(ctx.variants) == 0  # nothing compiles before the first call
    assert_exact(_run(outer, inputs), expected)  # measured 0
    assert len(ctx.variants) == 3  # glue, one block variant shared by all three blocks, glue


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_rewrite_linear_reads_weights_from_a_slot(captured, precision):
    rt, gm, inputs, _expected, ctx = captured
    template, args = _block_template(rt, gm, inputs, ctx, block=1)
    rt.set_precision(precision)
    vctx = VariantContext(ctx, block=1, precision=precision)
    rewritten = vctx.run([passes.rewrite_linear], copy.deepcopy(template))
    assert not [n for n in rewritten.graph.nodes if is_streamed_linear(n)]
    assert _count(rewritten, OPS["linear"]) == 2
    assert [n.name for n in rewritten.graph.nodes if n.op == "placeholder"][-3:] == [WEIGHTS, BLOCK_TOK, PREV_TOK]
    assert [r.name for r in vctx.passes_ran] == ["rewrite_linear"] and precision in vctx.passes_ran[0].notes[0]
    weights = rt.store.buffer(1, precision)  # the host bytes a slot would hold
    got = _run(rewritten, (*args, weights, rt.block_tokens[1], rt.block_tokens[0]))
    want = _run(template, args)  # the eager op reads the same bytes through the pool
    assert_exact(got, want)  # measured 0


def test_schedule_forward_waits_prefetches_and_evicts(captured):
    rt, gm, inputs, _expected, ctx = captured
    template, args = _block_template(rt, gm, inputs, ctx, block=1)
    vctx = VariantContext(ctx, block=1, precision="bf16")
    rewritten = vctx.run([passes.rewrite_linear], copy.deepcopy(template))
    scheduled = vctx.run([passes.schedule_forward], copy.deepcopy(rewritten))
    assert WEIGHTS not in [n.name for n in scheduled.graph.nodes]
    for op in ("wait", "prefetch", "evict"):
        assert _count(scheduled, OPS[op]) == 1, op
    assert [n.name for n in scheduled.graph.nodes if n.op == "placeholder"][-4:] == list(TOKEN_INPUTS)
    wait = next(n for n in scheduled.graph.nodes if n.target is OPS["wait"])
    evict = next(n for n in scheduled.graph.nodes if n.target is OPS["evict"])
    linears = [n for n in scheduled.graph.nodes if n.target is OPS["linear"]]
    assert wait.args[2] == rt.block_nbytes(1, "bf16") and wait.args[3] == precisions.get("bf16").code
    assert set(evict.args[2]) == set(linears) and all(n.args[1] is wait for n in linears)
    toks = (rt.block_tokens[1], rt.block_tokens[1], rt.block_tokens[2], rt.block_tokens[0])  # fetch, block, next, prev
    with torch.no_grad():
        out = scheduled(*args, *toks)
    assert_exact(out[0], _run(template, args))  # measured 0
    assert out[-1].dtype == torch.int64  # the next block's fetch token
    assert not [s for s in rt.pool.slots if s.state is SlotState.IN_USE]  # the evict released the block


def _backward_graph(rt) -> tuple[fx.Graph, list]:
    """A hand-made joint-graph tail: two linears' backward of block 0, each with its own wait_bw and prefetch."""
    up, down = (i for i, s in enumerate(rt.layers) if s.block == 0)
    nbytes, code = rt.block_nbytes(0, "bf16"), precisions.get("bf16").code
    g = fx.Graph()
    tok, prev, anchor, dy = (g.placeholder(n) for n in ("block_tok", "prev_tok", "anchor", "dy"))
    w1 = g.call_function(OPS["wait_bw"], (tok, anchor, nbytes, code, torch.device("cpu")))
    g.call_function(OPS["prefetch"], (prev, [w1]))
    r1 = g.call_function(OPS["linear_grad_input"], (dy, w1, rt.layer_layout(down, "bf16")))
    w2 = g.call_function(OPS["wait_bw"], (tok, anchor, nbytes, code, torch.device("cpu")))
    g.call_function(OPS["prefetch"], (prev, [w2]))
    r2 = g.call_function(OPS["linear_grad_input"], (r1, w2, rt.layer_layout(up, "bf16")))
    g.output((r2,))
    dy_value = torch.randn(2, 5, 32)
    return g, [rt.block_tokens[0], rt.no_block_token, torch.zeros(()), dy_value]


def test_schedule_backward_keeps_one_wait_and_prefetch_and_evicts_after_the_last_reader(captured):
    rt = captured[0]
    graph, args = _backward_graph(rt)
    before = fx.GraphModule(torch.nn.Module(), copy.deepcopy(graph))
    want = before(*args)[0]
    rt.abort_held_blocks()  # the unscheduled graph never released the block
    log = JointPasses(passes.JOINT_PASSES).log
    after = fx.GraphModule(torch.nn.Module(), log.run(passes.JOINT_PASSES, graph))
    for op, n in (("wait_bw", 1), ("prefetch", 1), ("evict", 1)):
        assert _count(after, OPS[op]) == n, op
    nodes = [n for n in after.graph.nodes if n.op == "call_function"]
    evict = nodes[-1]
    assert evict.target is OPS["evict"] and len(evict.args[2]) == 2  # both readers, after the last one
    assert "2 wait_bw -> 1" in next(p for p in log.passes_ran if p.name == "schedule_backward").notes[0]
    assert_exact(after(*args)[0], want)  # measured 0
    assert not [s for s in rt.pool.slots if s.state is SlotState.IN_USE]


def test_pass_lists_are_ordered_and_named():
    assert passes.pass_names(passes.GRAPH_PASSES) == [
        "inline_checkpoints", "causal_attention", "annotate_blocks", "assign_segments", "split_segments", "link_units"]
    assert passes.pass_names(passes.VARIANT_PASSES) == ["rewrite_linear", "schedule_forward"]
    assert passes.pass_names(passes.JOINT_PASSES) == ["refetch_weights", "schedule_backward"]


def test_hash_of_sources_changes_with_the_text():
    assert source_hash.hash_sources(["def f(): pass"]) == source_hash.hash_sources(["def f(): pass"])
    assert source_hash.hash_sources(["def f(): pass"]) != source_hash.hash_sources(["def f(): return 1"])
    assert source_hash.hash_sources(["ab", "c"]) != source_hash.hash_sources(["a", "bc"])


@pytest.mark.parametrize("edited_module", ["schedule_backward", "graph_nodes"])
def test_joint_pass_uuid_follows_the_pass_source(edited_module, monkeypatch):
    """A pass's own module, or a compiler helper it uses (refetch_weights walks the graph with
    graph_nodes.descendants): an edit to either must miss Inductor's FX cache."""
    original = passes.joint_passes_uuid()
    assert JointPasses(passes.JOINT_PASSES).uuid() == original  # what Inductor's FX cache keys on
    real_getsource = source_hash.inspect.getsource

    def edited(obj):
        text = real_getsource(obj)
        return text + "\n# edited\n" if obj.__name__.endswith("." + edited_module) else text

    monkeypatch.setattr(source_hash.inspect, "getsource", edited)
    assert passes.joint_passes_uuid() != original


def test_runtime_implements_the_protocol_and_close_drops_its_variants():
    model, x = toy(n=2)
    rt = stagehand.offload(model, device="cpu")
    assert isinstance(rt, StreamingRuntime)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="stagehand", options={"inner": "eager"})(x)
    cache = variant_cache(rt)
    assert len(cache) > 0 and variant_cache(rt) is cache
    assert not hasattr(rt, "variants") and not hasattr(rt, "variant_info")  # the compiler owns them
    rt.restore()
    assert len(cache) == 0


def test_explain_lists_the_passes_that_ran():
    model, x = toy(n=2)
    model.embed.requires_grad_(True)
    stagehand.offload(model, device="cpu")
    report = stagehand.explain(model, x)
    graph_level = [p["name"] for p in report.passes if p["unit"] == ""]
    assert graph_level == passes.pass_names(passes.GRAPH_PASSES)
    block = [p for p in report.passes if p["unit"].startswith("block_variant")]
    assert [p["name"] for p in block] == ["rewrite_linear", "schedule_forward", "refetch_weights", "schedule_backward"]
    assert all(p["notes"] for p in block)
    assert "schedule_forward" in report.pass_table()


def test_inline_checkpoints_turns_checkpoint_bodies_into_block_recompute():
    """A model's own checkpoint (Dynamo's tag_activation_checkpoint op) is inlined and marked for recompute."""
    from _helpers import CheckpointedToy

    from torch_stagehand.compiler.passes.inline_checkpoints import RECOMPUTE, is_checkpoint

    model, x = toy(n=3)
    wrapped = CheckpointedToy(model)
    plain = copy.deepcopy(wrapped)
    rt = stagehand.offload(wrapped, device="cpu")
    block_frames.frames_of(rt).remove()  # the blocks inlined: the checkpoint ops in one graph
    graphs = []
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(wrapped, backend=lambda gm, ex: graphs.append((gm, list(ex))) or gm.forward)(x)
        expected = plain(x)
    gm, inputs = graphs[0]
    assert sum(is_checkpoint(n) for n in gm.graph.nodes) == 3 and not any(is_streamed_linear(n) for n in gm.graph.nodes)
    ctx = CompileContext(rt, BackendOptions("eager"), variant_cache(rt), passes.VARIANT_PASSES, passes.JOINT_PASSES,
                         tokens=token_owners(gm, inputs))
    gm = ctx.run([passes.inline_checkpoints], gm)
    assert not any(is_checkpoint(n) for n in gm.graph.nodes)
    linears = [n for n in gm.graph.nodes if is_streamed_linear(n)]
    assert len(linears) == 6 and all(n.meta.get(RECOMPUTE) for n in linears)
    assert not any(n.meta.get(RECOMPUTE) for n in gm.graph.nodes if n.op == "placeholder")
    assert "3 checkpointed regions inlined" in ctx.passes_ran[0].notes[0]
    assert_exact(_run(gm, inputs), expected)  # measured 0
    # the partition then finds the three blocks, each marked to recompute
    gm = ctx.run([passes.annotate_blocks, passes.assign_segments], gm)
    assert [s.block for s in ctx.segments if s.recompute] == [0, 1, 2]
    rt.close()
