"""Compiling one unit (a block variant or a glue segment) with the inner compiler.

Both paths go through AOTAutograd, and both run the joint passes (the
caller hands in `passes.JOINT_PASSES`) on the joint graph before it is
partitioned: "eager" through our partition_fn, "inductor" through Inductor's
`joint_custom_post_pass`, whose cache uuid is a hash of the passes' source
(`source_hash.passes_uuid`). The forward, backward and inference graphs that
come out are handed to `on_graph` (for explain); the joint passes note what
they did in the `PassLog` given.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.fx as fx

from .context import PassLog
from .source_hash import passes_uuid

OnGraph = Callable[[str, fx.GraphModule], None]


def _eager_backward_lowering():
    # Compile the backward with the forward (first call), not at the first backward;
    # explain() then sees every graph without running a backward. Older torch lacks it.
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
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            partition_fn=partition,
        )


class JointPasses:
    """The joint passes as one Inductor joint-graph pass (a CustomGraphPass, so FX graph caching keys on it)."""

    def __init__(self, passes: Sequence[Callable], log: PassLog | None = None):
        self.passes = tuple(passes)
        self.log = log if log is not None else PassLog()

    def __call__(self, graph: fx.Graph) -> None:
        self.log.run(self.passes, graph)

    def uuid(self) -> str:
        return passes_uuid(self.passes)


def _custom_pass(joint: JointPasses):
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # pragma: no cover - older torch
        return joint
    return type("StagehandJointPasses", (JointPasses, CustomGraphPass), {})(joint.passes, joint.log)


def compile_inductor(gm: fx.GraphModule, example_inputs: list, on_graph: OnGraph, joint: JointPasses,
                     replay_rng: bool = False):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph_module: fx.GraphModule, inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        on_graph(kind, graph_module)
        return compile_fx_inner(graph_module, inputs, **kwargs)

    # A recomputed block's two variants must draw random numbers as eager does (from the generators
    # the recompute restores, in program order), not from Inductor's own seeds.
    patches = dict(joint_custom_post_pass=_custom_pass(joint)) | (dict(fallback_random=True) if replay_rng else {})
    with inductor_config.patch(**patches), _eager_backward_lowering():
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def compile_unit(gm: fx.GraphModule, example_inputs: list, inner: str, on_graph: OnGraph,
                 joint_passes: Sequence[Callable], log: PassLog | None = None, replay_rng: bool = False):
    """`replay_rng`: the unit is recomputed in backward and must replay its forward's random numbers."""
    joint = JointPasses(joint_passes, log)
    if inner == "eager":
        return compile_eager(gm, example_inputs, on_graph, joint)
    return compile_inductor(gm, example_inputs, on_graph, joint, replay_rng)
