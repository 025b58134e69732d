"""Compiling one unit (a block variant or a glue segment) with the inner compiler. Both paths go through AOTAutograd
and run the joint passes on the joint graph before it is partitioned: "eager" through our partition_fn, "inductor"
through Inductor's `joint_custom_post_pass` (its cache uuid hashes the passes' source). The graphs that come out are
handed to `on_graph` (for explain)."""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import threading
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.fx as fx

from torch_stagehand.compiler.startup.compile_cache import cacheable_functions, import_order_free_keys, ops_fingerprint
from torch_stagehand.compiler.context import PassLog
from torch_stagehand.compiler.mutation import MutationIndex
from torch_stagehand.compiler.startup.process_settings import AUTOTUNED, autotune_choice
from torch_stagehand.compiler.source_hash import passes_uuid
from torch_stagehand.compiler.symbolic import fake_static
from torch_stagehand.environment import env

if TYPE_CHECKING:
    from torch_stagehand.compiler.symbolic import FakedInputs

OnGraph = Callable[[str, fx.GraphModule], None]
log = logging.getLogger("torch_stagehand.compiler")


def compile_workers_wanted(device: torch.device) -> bool:
    """Start Inductor's compile workers at offload? On CUDA (CPU kernels compile in process), unless
    `STAGEHAND_WARM_COMPILE_WORKERS=0`; `TORCH_WARM_POOL=0` and `TORCHINDUCTOR_COMPILE_THREADS=1` too, as for torch."""
    return device.type == "cuda" and env("STAGEHAND_WARM_COMPILE_WORKERS")


def warm_compile_workers(device: torch.device) -> bool:
    """Start Inductor's compile workers now, when `compile_workers_wanted` (torch's backend does; calling
    `compile_fx` per unit we must, or the first units' kernels compile serially here). True when asked for."""
    if not compile_workers_wanted(device):
        return False
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()  # idempotent: the pool is made once per process
    return True


def prewarm_compiler_imports(source_files: Sequence[str] = ()) -> None:
    """Import Inductor's and AOTAutograd's modules, start `prewarm_cache_keys` on a thread, index `source_files`
    for Dynamo. Never on a thread of its own: two threads importing one circle of modules see half-made modules."""
    import torch._functorch.aot_autograd  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    threading.Thread(target=prewarm_cache_keys, name="stagehand-cache-keys", daemon=True).start()
    index_sources_for_dynamo(source_files)


def dynamo_source_files(model: torch.nn.Module) -> list[str]:
    """The source files Dynamo will read tracing `model`: of its modules' methods and the objects they call
    (attention processors), of the functions those call by a global name, of StreamedMixin and torch.nn.functional."""
    import types

    from torch_stagehand.runtime.streamed import StreamedMixin

    classes = {StreamedMixin: None}
    for module in model.modules():
        classes[type(module)] = None
        for value in vars(module).values():
            if not isinstance(value, (torch.nn.Module, torch.Tensor)) and callable(value) and not isinstance(
                    value, (types.FunctionType, types.MethodType, type)) and hasattr(type(value), "__dict__"):
                classes[type(value)] = None  # an object the module calls: an attention processor
    files = {torch.nn.functional.dropout.__code__.co_filename: None}
    for cls in classes:
        namespace = vars(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else {}
        for method in vars(cls).values():
            code = getattr(method, "__code__", None)
            if code is None:
                continue
            files[code.co_filename] = None
            for name in code.co_names:
                called = namespace.get(name)
                if isinstance(called, types.FunctionType):
                    files[called.__code__.co_filename] = None
    return list(files)


def index_sources_for_dynamo(files: Sequence[str]) -> None:
    """Fill Dynamo's index of which function each source line is in (it tokenizes a whole file at first sight)."""
    try:
        from torch._dynamo import funcname_cache

        add = funcname_cache._add_file
    except (ImportError, AttributeError):  # a torch without them: Dynamo builds its index as it goes
        return
    for path in files:
        if path not in funcname_cache.cache:
            add(path)


def prewarm_cache_keys() -> None:
    """Work out the (functools-cached) hashes torch's compile caches put in every key before the first unit needs
    them: Triton's build and, once Inductor is imported, torch's sources. Imports nothing (it runs on a thread)."""
    try:
        from triton.runtime.cache import triton_key  # triton is imported with the kernels

        triton_key()
        if "torch._inductor.codecache" in sys.modules:
            from torch._inductor.codecache import CacheBase, torch_key

            torch_key()
            CacheBase.get_system()
    except Exception as error:  # noqa: BLE001 - an older or newer torch or Triton without them: nothing is lost
        log.debug("stagehand: cache-key prewarm skipped: %s", error)


def _eager_backward_lowering():
    # Compile the backward with the forward, so explain() sees every graph without a backward. Older torch lacks it.
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def compile_eager(gm: fx.GraphModule, example_inputs: list, on_graph: OnGraph, joint: "JointPasses"):
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(kind: str):
        def compile_graph(graph_module: fx.GraphModule, _inputs):
            on_graph(kind, graph_module)
            return make_boxed_func(graph_module.forward)

        return compile_graph

    def partition(joint_gm: fx.GraphModule, joint_inputs, **kwargs):
        joint(joint_gm.graph)
        joint_gm.recompile()
        return min_cut_rematerialization_partition(joint_gm, joint_inputs, **kwargs)

    with _eager_backward_lowering():
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler("forward"),
                                     bw_compiler=compiler("backward"), inference_compiler=compiler("inference"),
                                     partition_fn=partition)


class JointPasses:
    """The joint passes as one Inductor joint-graph pass (a CustomGraphPass, so FX graph caching keys on it)."""

    def __init__(self, passes: Sequence[Callable], log: PassLog | None = None):
        self.passes = tuple(passes)
        self.log = log if log is not None else PassLog()

    def __call__(self, graph: fx.Graph) -> None:
        self.log.run(self.passes, graph)

    def uuid(self) -> str:
        # The ops' fake and autograd rules are traced into the joint graph too: an edit to them must miss.
        return f"{passes_uuid(self.passes)}-ops-{ops_fingerprint()}"


def compile_inductor(gm: fx.GraphModule, example_inputs: list, on_graph: OnGraph, joint: JointPasses,
                     replay_rng: bool = False):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.custom_graph_pass import CustomGraphPass

    def inner_compile(graph_module: fx.GraphModule, inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        on_graph(kind, graph_module)
        return compile_fx_inner(graph_module, inputs, **kwargs)

    custom_pass = type("StagehandJointPasses", (JointPasses, CustomGraphPass), {})(joint.passes, joint.log)
    # A recomputed block's variants draw random numbers from the generators the recompute restores, as eager does.
    patches = dict(joint_custom_post_pass=custom_pass,
                   unsafe_marked_cacheable_functions={**inductor_config.unsafe_marked_cacheable_functions,
                                                      **cacheable_functions()})
    patches |= dict(fallback_random=True) if replay_rng else {}
    patches |= one_config_per_kernel(inductor_config)
    with inductor_config.patch(**patches), _eager_backward_lowering():
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def one_config_per_kernel(inductor_config) -> dict:
    """Inductor's config for one launch config per Triton kernel of the kinds `STAGEHAND_INDUCTOR_AUTOTUNE` leaves
    out, instead of several timed at its first launch in the step: a reduction's is deterministic mode's pick
    (`dynamic_scale_rblock` off: no second config grown at its first launch), a pointwise kernel's the untimed
    heuristic. A torch without these switches gets Inductor's default."""
    timed, patches = AUTOTUNED[autotune_choice()], {}
    if "pointwise" not in timed and hasattr(inductor_config.triton, "autotune_pointwise"):
        patches["triton.autotune_pointwise"] = False
    if "reductions" not in timed and hasattr(getattr(inductor_config, "test_configs", None),
                                             "force_filter_reduction_configs"):
        patches["test_configs.force_filter_reduction_configs"] = True
    if "reductions" not in timed and hasattr(inductor_config, "dynamic_scale_rblock"):
        patches["dynamic_scale_rblock"] = False
    return patches


def compile_unit(gm: fx.GraphModule, example_inputs: list, inner: str, on_graph: OnGraph,
                 joint_passes: Sequence[Callable], log: PassLog | None = None, replay_rng: bool = False,
                 faked: "FakedInputs | None" = None):
    """`replay_rng`: the unit is recomputed and replays its forward's random numbers. `faked`: compile from these
    fake inputs (symbolic.py), not the real ones."""
    joint = JointPasses(joint_passes, log)
    gm = _bake_scalar_reads(gm, example_inputs)
    if faked is None and inner == "inductor":
        faked = fake_static(example_inputs)  # the compile caches need a ShapeEnv (compiler/startup/compile_cache.py)
    inputs, context = (example_inputs, contextlib.nullcontext()) if faked is None else (faked.values, faked.tracing())
    with context, import_order_free_keys():
        if inner == "eager":
            return compile_eager(gm, inputs, on_graph, joint)
        return compile_inductor(gm, inputs, on_graph, joint, replay_rng)


class ScalarReadAfterWriteError(RuntimeError):
    """A unit reads `.item()` of an input after writing into it: the value at call time cannot be baked in."""


def _bake_scalar_reads(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
    """A copy of `gm` in which `.item()` of a 0-dim input is the number the input holds now: under `dynamic=True`
    Dynamo passes Python floats (a norm's eps) as 0-dim tensors, which cannot be traced outside Dynamo. The
    variant key holds the value (symbolic.input_key), so another value compiles another variant."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reads = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "item"
             and n.args[0] in placeholders and isinstance(example_inputs[placeholders.index(n.args[0])], torch.Tensor)]
    if not reads:
        return gm
    # A write before the read would change the value baked in (compiler/mutation.py).
    writes, order = MutationIndex.of(gm.graph), {n: i for i, n in enumerate(gm.graph.nodes)}
    for read in reads:
        before = [w.name for w in writes.writers([read.args[0]]) if order[w] < order[read]]
        if before:
            raise ScalarReadAfterWriteError(
                f"stagehand: input {read.args[0].name} is written in place ({', '.join(before)}) before its "
                f".item() is read ({read.name}); under dynamic shapes that read is compiled in as the input's "
                "value, which the write changes. Compile with dynamic=False, or move the write out of the model")
    baked = copy.deepcopy(gm)
    nodes, baked_nodes = list(gm.graph.nodes), list(baked.graph.nodes)
    for read in reads:
        value = example_inputs[placeholders.index(read.args[0])].item()
        node = baked_nodes[nodes.index(read)]
        node.replace_all_uses_with(value)
        baked.graph.erase_node(node)
    baked.recompile()
    return baked
