"""Warm starts (compiler/startup/compile_cache.py): a second process loads every unit the first one compiled.

Each run is a fresh process with its own Inductor cache folder, so only the stagehand bundle carries
compiled units from one to the next (as on a machine that lost /tmp). The model is a tiny random Llama,
full fine-tuned (its streamed weights train: the grad-weight taps are in the units), INT8-streamed, compiled
with Inductor on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torch_stagehand.compiler.startup import compile_cache
from torch_stagehand.compiler.startup.compile_cache import CompileBundle, _join

CHILD = textwrap.dedent(r'''
    import inspect, json, sys
    import torch
    import torch_stagehand as stagehand
    from transformers import LlamaConfig, LlamaForCausalLM

    mode = sys.argv[1]
    if mode == "edited":  # a pass whose source changed since the bundle was written
        import torch_stagehand.compiler.passes  # noqa: F401 - the package names its function like its module
        edited = sys.modules["torch_stagehand.compiler.passes.schedule_backward"]
        getsource = inspect.getsource
        inspect.getsource = lambda obj: getsource(obj) + ("\n# edited\n" if obj is edited else "")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config)
    rt = stagehand.offload(model, device="cpu", precision="int8")
    compiled = torch.compile(model, backend="stagehand")

    def step(tokens):
        ids = torch.arange(2 * tokens).reshape(2, tokens) % 128
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.double().norm().item() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        s = rt.stats()
        from torch._dynamo.utils import counters
        return {"loss": loss.item(), "grads": grads, "units": s["compiled_units"], "loaded": s["units_loaded"],
                "cold": s["units_compiled_cold"], "inductor_misses": counters["inductor"]["fxgraph_cache_miss"]}

    out = {"first": step(16)}
    from torch_stagehand.compiler.variants import variant_cache
    out["last_run_units"] = variant_cache(rt).bundle.last_run_units  # what the progress line estimates from
    if mode == "warm":
        rt.set_precision({0: "bf16", 1: "int8"})  # a precision the bundle never saw
        out["precision"] = step(16)
        out["shape"] = step(24)  # a shape it never saw
    print("RESULT " + json.dumps(out))
''')


def _run(mode: str, stagehand_dir, inductor_dir) -> dict:
    env = dict(os.environ, STAGEHAND_CACHE_DIR=str(stagehand_dir), TORCHINDUCTOR_CACHE_DIR=str(inductor_dir),
               STAGEHAND_COMPILE_CACHE="1")
    done = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]) | {"stderr": done.stderr}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cold run, then a warm one and one with an edited pass, each with a fresh Inductor cache."""
    root = tmp_path_factory.mktemp("warm_start")
    stagehand_dir = root / "stagehand"
    cold = _run("cold", stagehand_dir, root / "inductor-cold")
    bundles = list((stagehand_dir / "compile").glob("*.bundle"))
    warm = _run("warm", stagehand_dir, root / "inductor-warm")
    edited = _run("edited", stagehand_dir, root / "inductor-edited")
    return cold, warm, edited, bundles


def test_the_second_process_compiles_nothing_and_computes_the_same(runs):
    cold, warm, _, bundles = runs
    assert len(bundles) == 1, "the cold run writes one bundle for the model"
    assert cold["first"]["units"] >= 1 and cold["first"]["loaded"] == 0  # block variants (the code around the blocks runs eagerly)
    assert warm["first"]["cold"] == 0, warm["stderr"][-3000:]
    # nothing compiled again in Inductor: the bundle carried it all
    assert cold["first"]["inductor_misses"] >= 2 and warm["first"]["inductor_misses"] == 0
    assert warm["first"]["loaded"] == warm["first"]["units"] == cold["first"]["units"]
    assert cold["last_run_units"] == 0 and warm["last_run_units"] == cold["first"]["units"]
    # the same compiled code: the same numbers, bit for bit
    assert warm["first"]["loss"] == cold["first"]["loss"]
    assert warm["first"]["grads"] == cold["first"]["grads"] and len(cold["first"]["grads"]) > 10


def test_a_new_precision_or_shape_misses_the_cache(runs):
    _, warm, _, _ = runs
    assert warm["precision"]["cold"] >= 1  # block 0's bf16 variant was never compiled
    assert warm["shape"]["cold"] > warm["precision"]["cold"]  # a new length compiles its units


def test_an_edited_pass_misses_every_unit(runs):
    _, _, edited, _ = runs
    assert edited["first"]["loaded"] == 0 and edited["first"]["cold"] == edited["first"]["units"] >= 1


# ---- the bundle file's checks (no compile) ------------------------------------------------------------

def _bundle(tmp_path, header_env=None, payload=b"payload", sha=None) -> CompileBundle:
    bundle = CompileBundle(str(tmp_path / "model.bundle"), torch.device("cpu"))
    header = {"format": 1, "env": header_env or bundle.env, "artifacts": 1,
              "sha256": sha or __import__("hashlib").sha256(payload).hexdigest()}
    (tmp_path / "model.bundle").write_bytes(_join(header, payload))
    return bundle


@pytest.fixture
def no_populate(monkeypatch):
    """Fail the test if a refused bundle reaches torch's caches."""
    def refuse(_payload):
        raise AssertionError("a refused bundle was loaded")
    monkeypatch.setattr(compile_cache, "_load_artifacts", refuse)


def test_a_corrupt_bundle_is_ignored_with_its_reason(tmp_path, no_populate, caplog):
    bundle = _bundle(tmp_path, sha="0" * 64)
    assert not bundle.load()
    assert "corrupt" in bundle.message and str(tmp_path) in bundle.message
    assert "corrupt" in caplog.text


def test_a_bundle_from_other_versions_is_ignored_and_says_which(tmp_path, no_populate):
    bundle = _bundle(tmp_path, header_env={**CompileBundle("x", torch.device("cpu")).env, "torch": "2.0.0"})
    assert not bundle.load()
    assert "torch '2.0.0'" in bundle.message and f"here '{torch.__version__}'" in bundle.message


@pytest.mark.parametrize("content", [b"", b"not a bundle", b"STAGEHAND-COMPILE-BUNDLE\x05\x00\x00\x00{bad"])
def test_an_unreadable_bundle_is_ignored(tmp_path, no_populate, content):
    (tmp_path / "model.bundle").write_bytes(content)
    bundle = CompileBundle(str(tmp_path / "model.bundle"), torch.device("cpu"))
    assert not bundle.load() and "unreadable" in bundle.message


def test_no_bundle_yet_says_it_compiles_cold(tmp_path, no_populate):
    bundle = CompileBundle(str(tmp_path / "absent.bundle"), torch.device("cpu"))
    assert not bundle.load() and "compiles cold" in bundle.message


def test_every_function_a_variant_graph_calls_is_marked_cacheable():
    from torch_stagehand.runtime.ops import grad_tap
    from torch_stagehand.runtime.precision.int8 import int8_linear_in_graph
    from torch_stagehand.runtime.precision.traced import IN_GRAPH_FUNCTIONS

    marked = compile_cache.cacheable_functions()
    assert int8_linear_in_graph in IN_GRAPH_FUNCTIONS  # int8 at many rows is traced into the block's graph
    for fn in (grad_tap, *IN_GRAPH_FUNCTIONS):
        assert f"{fn.__module__}.{fn.__name__}" in marked


def test_the_keys_follow_the_source_of_every_module_that_decides_what_a_variant_traces(monkeypatch):
    from torch_stagehand.runtime import ops
    from torch_stagehand.runtime.experts import stacks as experts

    hashed = []
    real = compile_cache._sources_hash
    monkeypatch.setattr(compile_cache, "_sources_hash", lambda modules: hashed.append(list(modules)) or real(modules))
    marked = compile_cache.cacheable_functions()
    compile_cache.ops_fingerprint()
    # The expert stack read: its in-graph math and its op's fake rule live in experts/stacks.py.
    assert f"{experts.__name__}.expert_weights_from_slot" in marked
    assert experts in hashed[0] and ops in hashed[0]
    assert experts in hashed[1] and ops in hashed[1]


def test_the_source_hash_follows_every_file_of_a_package(tmp_path):
    import types

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    package = types.SimpleNamespace(__path__=[str(tmp_path)])
    before = compile_cache._sources_hash([package])
    (tmp_path / "b.py").write_text("y = 3\n")
    assert compile_cache._sources_hash([package]) != before


# ---- Inductor's compile workers ------------------------------------------------------------------------------

WORKERS_CHILD = textwrap.dedent(r'''
    import json, torch
    import torch_stagehand as stagehand
    from torch._inductor.async_compile import AsyncCompile
    from transformers import LlamaConfig, LlamaForCausalLM

    before = AsyncCompile.process_pool.cache_info().currsize
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    stagehand.offload(model, device="cuda", verbose=False)
    print("RESULT " + json.dumps({"before": before, "after": AsyncCompile.process_pool.cache_info().currsize}))
''')


def test_the_compile_workers_are_started_for_cuda_alone_unless_turned_off(monkeypatch):
    from torch_stagehand.compiler.inner import compile_workers_wanted, warm_compile_workers

    monkeypatch.delenv("STAGEHAND_WARM_COMPILE_WORKERS", raising=False)
    assert compile_workers_wanted(torch.device("cuda"))  # on by default: 8 s of a cold Flux step (H100)
    assert not compile_workers_wanted(torch.device("cpu"))  # CPU kernels compile in process: no pool to start
    assert not warm_compile_workers(torch.device("cpu"))
    monkeypatch.setenv("STAGEHAND_WARM_COMPILE_WORKERS", "0")
    assert not warm_compile_workers(torch.device("cuda"))


@pytest.mark.gpu
def test_offload_on_cuda_starts_inductors_compile_workers_before_the_first_compile():
    """A fresh process: no pool before offload, one after it (before anything compiled), as torch's own
    inductor backend has once it is handed a graph."""
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="4", TORCH_WARM_POOL="1", STAGEHAND_WARM_COMPILE_WORKERS="1")
    done = subprocess.run([sys.executable, "-c", WORKERS_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert result == {"before": 0, "after": 1}


def test_a_units_key_does_not_depend_on_the_order_modules_were_imported_in():
    """torch's key pickler names a memory format (in every input's metadata) after the first module in
    sys.modules that reaches `torch.contiguous_format`: on an H100 the main process said
    `transformers.image_processing_utils_fast` where an ahead-compile worker said `torch._utils`, and missed
    every variant the worker stored. Around a unit's compile (import_order_free_keys) the key is the same
    whichever module comes first."""
    import pickle

    import torch.fx as fx
    from torch._inductor.codecache import FxGraphCachePickler

    from torch_stagehand.compiler.symbolic import fake_static

    gm = fx.symbolic_trace(lambda x: (x + 1,))
    inputs = fake_static([torch.randn(4, 8)]).values

    def key() -> str:
        return FxGraphCachePickler(gm).get_hash(inputs)

    def move_first_holder_to_the_end() -> str:
        name = pickle.whichmodule(torch.contiguous_format, "torch.contiguous_format")
        sys.modules[name] = sys.modules.pop(name)  # re-inserted last: another module is found first now
        return name

    before = key()
    with compile_cache.import_order_free_keys():
        canonical = key()
    first = move_first_holder_to_the_end()
    assert pickle.whichmodule(torch.contiguous_format, "torch.contiguous_format") != first
    assert key() != before  # torch's own key moved with the import order
    with compile_cache.import_order_free_keys():
        assert key() == canonical
    assert FxGraphCachePickler.__init__.__qualname__ == "FxGraphCachePickler.__init__"  # put back


def test_units_compile_one_config_per_kernel_of_the_kinds_not_autotuned(monkeypatch):
    """Every unit compiles under the one-config switches STAGEHAND_INDUCTOR_AUTOTUNE asks for (no configs timed at
    a kernel's first launch: seconds of a cold first step), the same in a worker and in the main process (both go
    through compile_unit); "1" gives Inductor's default back, and a value it does not know is named."""
    import torch.fx as fx

    from torch._inductor import config as inductor_config

    from torch_stagehand.compiler.inner import compile_unit, one_config_per_kernel
    from torch_stagehand.compiler.passes import JOINT_PASSES

    monkeypatch.setenv("STAGEHAND_INDUCTOR_AUTOTUNE", "none")
    assert one_config_per_kernel(inductor_config) == {"triton.autotune_pointwise": False,
                                                      "test_configs.force_filter_reduction_configs": True,
                                                      "dynamic_scale_rblock": False}
    seen = []

    def on_graph(kind, gm):  # called inside the compile, under its config
        seen.append((kind, inductor_config.triton.autotune_pointwise,
                     inductor_config.test_configs.force_filter_reduction_configs, inductor_config.dynamic_scale_rblock))

    gm = fx.symbolic_trace(lambda x: torch.relu(x).sum(-1))
    torch._dynamo.reset()
    compile_unit(gm, [torch.randn(4, 8)], "inductor", on_graph, JOINT_PASSES)
    assert seen and all(s[1:] == (False, True, False) for s in seen), seen
    assert inductor_config.triton.autotune_pointwise is True  # only while a unit compiles
    assert inductor_config.dynamic_scale_rblock is True
    monkeypatch.setenv("STAGEHAND_INDUCTOR_AUTOTUNE", "pointwise")
    assert one_config_per_kernel(inductor_config) == {"test_configs.force_filter_reduction_configs": True,
                                                      "dynamic_scale_rblock": False}
    monkeypatch.setenv("STAGEHAND_INDUCTOR_AUTOTUNE", "reductions")
    assert one_config_per_kernel(inductor_config) == {"triton.autotune_pointwise": False}
    monkeypatch.setenv("STAGEHAND_INDUCTOR_AUTOTUNE", "1")
    assert one_config_per_kernel(inductor_config) == {}
    monkeypatch.setenv("STAGEHAND_INDUCTOR_AUTOTUNE", "some")
    with pytest.raises(ValueError, match="STAGEHAND_INDUCTOR_AUTOTUNE must be one of .* got 'some'"):
        one_config_per_kernel(inductor_config)
