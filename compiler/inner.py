"""Compiling one unit (a block variant or a glue segment) with the inner compiler.

Both paths go through AOTAutograd, and both run `schedule_backward` on the
joint graph before it is partitioned: "eager" through our partition_fn,
"inductor" through Inductor's `joint_custom_post_pass`. The forward, backward
and inference graphs that come out are handed to `on_graph` (for explain).
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Callable

import torch
import torch.fx as fx

from .schedule import schedule_backward

OnGraph = Callable[[str, fx.GraphModule], None]


def _eager_backward_lowering():
    # Compile the backward with the forward (first call), not at the first backward;
    # explain() then sees every graph without running a backward. Older torch lacks it.
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        return config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def compile_eager(gm: fx.GraphModule, example_inputs: list, on_graph: OnGraph):
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(kind: str):
        def compile_graph(graph_module: fx.GraphModule, _inputs):
            on_graph(kind, graph_module)
            return make_boxed_func(graph_module.forward)

        return compile_graph

    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        schedule_backward(joint.graph)
        joint.recompile()
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    with _eager_backward_lowering():
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            partition_fn=partition,
        )


class _ScheduleBackwardPass:
    """Inductor joint-graph pass wrapper (a CustomGraphPass, so FX graph caching keys on it)."""

    _uuid = f"stagehand-schedule-backward-{uuid.uuid5(uuid.NAMESPACE_URL, 'torch-stagehand/schedule_backward/1')}"

    def __call__(self, graph: fx.Graph) -> None:
        schedule_backward(graph)

    def uuid(self):
        return self._uuid


def _custom_pass():
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # pragma: no cover - older torch
        return _ScheduleBackwardPass()
    return type("ScheduleBackwardPass", (_ScheduleBackwardPass, CustomGraphPass), {})()


def compile_inductor(gm: fx.GraphModule, example_inputs: list, on_graph: OnGraph):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph_module: fx.GraphModule, inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        on_graph(kind, graph_module)
        return compile_fx_inner(graph_module, inputs, **kwargs)

    with inductor_config.patch(joint_custom_post_pass=_custom_pass()), _eager_backward_lowering():
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def compile_unit(gm: fx.GraphModule, example_inputs: list, inner: str, on_graph: OnGraph):
    if inner == "eager":
        return compile_eager(gm, example_inputs, on_graph)
    return compile_inductor(gm, example_inputs, on_graph)
