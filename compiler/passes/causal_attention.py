"""Pass `causal_attention`: a constant causal mask handed to attention becomes `is_causal=True`.

Under torch.compile, transformers cannot look at data, so in training (no KV
cache) it builds the causal mask as a tensor: it would have to read the
position ids to rule out packed sequences, and a data-dependent branch is
what Dynamo cannot trace. SDPA then gets `attn_mask=<bool L x L>` and no
`is_causal`, which rules out flash attention: torch picks the memory-efficient
kernel with a mask (and transformers repeats K/V for GQA). On the Qwen2.5-7B
shape at 2048 tokens that costs 4x in the attention backward and ~40 ms a
step on an H100, against the same model run eagerly, where transformers checks
the data and passes `is_causal=True`.

When the mask is built from constants alone (no graph input, no parameter or
buffer among its ancestors: the position ids are an `arange` the model made
itself) its value is fixed for this graph. The pass evaluates it once, on the
device, and where it is exactly the lower triangle over (L, L), broadcast,
drops the mask and sets `is_causal=True`: the same attention, and SDPA may
pick flash. A mask that depends on an input (padding, packed sequences),
a symbolic size, or anything but the plain causal pattern (sliding window,
prefix-LM, an additive bias) is left as it is.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..context import CompileContext, compiler_pass
from ..graph_nodes import example_value, has_static_shape

_MASK_ARG, _CAUSAL_ARG = 3, 5  # positions in scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "scaled_dot_product_attention"


@compiler_pass("causal_attention")
def causal_attention(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    verdicts: dict[fx.Node, bool] = {}  # one evaluation per mask node (every layer shares the model's one mask)
    rewritten = 0
    for node in list(gm.graph.nodes):
        mask = _arg(node, "attn_mask", _MASK_ARG) if is_sdpa(node) else None
        if not isinstance(mask, fx.Node) or _arg(node, "is_causal", _CAUSAL_ARG):
            continue
        if mask not in verdicts:
            verdicts[mask] = _is_constant_causal(gm, node, mask)
        if verdicts[mask]:
            _set(node, "attn_mask", _MASK_ARG, None)
            _set(node, "is_causal", _CAUSAL_ARG, True)
            rewritten += 1
    if rewritten:
        for mask, causal in verdicts.items():
            if causal:
                _erase_unused(gm.graph, mask)
        gm.recompile()
        ctx.note(f"{rewritten} attention call(s): a constant causal mask became is_causal=True (flash attention "
                 "may run; the mask is no longer built)")
    kept = [m.name for m, causal in verdicts.items() if not causal]
    if kept:
        ctx.note(f"attention mask(s) {kept} kept: built from inputs, or not the plain causal pattern")
    return gm


def _is_constant_causal(gm: fx.GraphModule, sdpa: fx.Node, mask: fx.Node) -> bool:
    ancestors = _ancestors(mask)
    if ancestors is None:
        return False
    query = sdpa.args[0] if sdpa.args else sdpa.kwargs.get("query")
    key = sdpa.args[1] if len(sdpa.args) > 1 else sdpa.kwargs.get("key")
    q_len, k_len = _static_dim(query, -2), _static_dim(key, -2)
    if q_len is None or q_len != k_len:
        return False  # is_causal is top-left aligned: the same mask only when L == S
    value = _evaluate(gm, ancestors, mask)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[-2:]) != (q_len, k_len):
        return False
    if value.dtype == torch.bool:
        allowed = value
    elif value.is_floating_point():
        lowest = torch.finfo(value.dtype).min
        blocked = torch.isneginf(value) | (value == lowest)
        if not bool(((value == 0) | blocked).all()):
            return False  # an additive bias (ALiBi, relative positions): not a mask alone
        allowed = ~blocked
    else:
        return False
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=allowed.device).tril()
    return bool(torch.equal(allowed, causal.expand_as(allowed)))


def _ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes the mask is computed from, in graph order; None if any is an input, a parameter or a buffer."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op in ("placeholder", "get_attr") or not _static(node):
            return None
        seen.add(node)
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _static(node: fx.Node) -> bool:
    """No symbolic size in what the node produced (a dynamic length would change the mask per call)."""
    value = example_value(node)
    return has_static_shape(value) if isinstance(value, torch.Tensor) else not isinstance(value, torch.SymInt)


def _static_dim(node, dim: int) -> int | None:
    value = example_value(node)
    return value.shape[dim] if has_static_shape(value) and value.dim() >= 2 else None


def _evaluate(gm: fx.GraphModule, ancestors: list[fx.Node], mask: fx.Node):
    """Run the mask's subgraph once (it reads no input) and return its value; None if it fails to run."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in ancestors:
        copies[node] = graph.node_copy(node, copies.__getitem__)
    graph.output(copies[mask])
    try:
        with torch.no_grad():
            return fx.GraphModule(gm, graph)()
    except Exception:  # noqa: BLE001 - an op that cannot run eagerly here: keep the mask, change nothing
        return None


def _erase_unused(graph: fx.Graph, mask: fx.Node) -> None:
    """Remove the mask and what only it used (in reverse order, so users go before their inputs)."""
    ancestors = _ancestors(mask) or []
    for node in reversed(ancestors):
        if not node.users:
            graph.erase_node(node)


def _arg(node: fx.Node, name: str, index: int):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else None


def _set(node: fx.Node, name: str, index: int, value) -> None:
    if len(node.args) > index:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


__all__ = ["causal_attention", "is_sdpa"]
