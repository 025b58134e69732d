"""Pass `causal_attention`: a causal mask built from constants becomes `is_causal=True` (a mask tensor rules out
SDPA's flash kernel).

A mask is rewritten only when it is built from constants (sizes aside), nothing writes in place into it or what
it is computed from (`compiler/mutation.py`), and its construction is the causal triangle over (L, L) for every
length (mask_proof.py), or, where the proof does not model an op and every size is static, evaluates to it. Any
other mask (padding, sliding window, an additive bias, L != S) is kept, and the pass says why.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torch_stagehand.compiler.context import CompileContext, compiler_pass
from torch_stagehand.compiler.graph_nodes import example_value, has_static_shape, node_arg
from torch_stagehand.compiler.passes.mask_proof import prove_causal, size_key
from torch_stagehand.compiler.mutation import MutationIndex

_MASK_ARG, _CAUSAL_ARG = 3, 5  # positions in scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
_SIZE_READS = {"size", "sym_size", "sym_numel", "dim"}  # read a tensor's shape, not its data


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "scaled_dot_product_attention"


@compiler_pass("causal_attention")
def causal_attention(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    writes = MutationIndex.of(gm.graph)
    verdicts: dict[fx.Node, tuple[bool, str]] = {}  # one decision per mask node (every layer shares the model's one)
    rewritten = 0
    for node in list(gm.graph.nodes):
        mask = node_arg(node, _MASK_ARG, "attn_mask") if is_sdpa(node) else None
        if not isinstance(mask, fx.Node) or node_arg(node, _CAUSAL_ARG, "is_causal"):
            continue
        if mask not in verdicts:
            verdicts[mask] = _decide(gm, node, mask, writes)
        if verdicts[mask][0]:
            _set(node, "attn_mask", _MASK_ARG, None)
            _set(node, "is_causal", _CAUSAL_ARG, True)
            rewritten += 1
    if rewritten:
        for mask, (causal, _) in verdicts.items():
            if causal:
                _erase_unused(gm.graph, mask)
        gm.recompile()
        how = sorted({why for causal, why in verdicts.values() if causal})
        ctx.note(f"{rewritten} attention call(s): a constant causal mask became is_causal=True (flash attention "
                 f"may run; the mask is no longer built): {'; '.join(how)}")
    for mask, (causal, why) in verdicts.items():
        if not causal:
            ctx.note(f"attention mask {mask.name} kept: {why}")
    return gm


def _decide(gm: fx.GraphModule, sdpa: fx.Node, mask: fx.Node, writes: MutationIndex) -> tuple[bool, str]:
    """(rewrite?, why) for one mask."""
    built_from = _construction(mask)
    if built_from is None:
        return False, "built from an input, a parameter or a buffer"
    writers = writes.writers(built_from)
    if writers:
        return False, f"written in place after it was built ({', '.join(sorted(w.name for w in writers))})"
    q_len, k_len = _dim(node_arg(sdpa, 0, "query"), -2), _dim(node_arg(sdpa, 1, "key"), -2)
    fake = example_value(mask)
    if q_len is None or k_len is None or size_key(q_len) != size_key(k_len):
        return False, "queries and keys of different lengths (is_causal is top-left aligned)"
    if not isinstance(fake, torch.Tensor) or fake.dim() < 2 or \
            [size_key(s) for s in fake.shape[-2:]] != [size_key(q_len), size_key(k_len)]:
        return False, "not an L x L mask"
    verdict, why = prove_causal(built_from)
    if verdict == "causal":
        static = all(has_static_shape(v) for v in map(example_value, built_from) if isinstance(v, torch.Tensor))
        return True, why + ("" if static else " (for every length)")
    if verdict == "other":
        return False, why
    if not all(_static(n) for n in built_from):
        return False, f"symbolic sizes, and the construction is not one the proof models ({why})"
    evaluated = _evaluate_causal(gm, built_from, mask)
    return evaluated, "evaluated: the causal triangle" if evaluated else f"evaluated: not the causal triangle ({why})"


def _construction(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes the mask is computed from, in graph order (a size read is a leaf); None if any reads an input's,
    parameter's or buffer's data."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        value = example_value(node)
        if node.op == "placeholder" and isinstance(value, (int, torch.SymInt)):
            continue  # a (symbolic) size passed in
        if node.op == "call_method" and node.target in _SIZE_READS or \
                node.op == "call_function" and getattr(node.target, "__name__", "") in _SIZE_READS:
            continue  # reads the shape only
        if node.op in ("placeholder", "get_attr"):
            return None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _static(node: fx.Node) -> bool:
    """No symbolic size in what the node produced, and not a placeholder."""
    value = example_value(node)
    if node.op == "placeholder" or isinstance(value, torch.SymInt):
        return False
    return has_static_shape(value) if isinstance(value, torch.Tensor) else True


def _dim(node, dim: int):
    value = example_value(node)
    return value.shape[dim] if isinstance(value, torch.Tensor) and value.dim() >= 2 else None


def _evaluate_causal(gm: fx.GraphModule, built_from: list[fx.Node], mask: fx.Node) -> bool:
    """Run the mask's construction once (static sizes, nothing written into it) and compare with the triangle."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in built_from:
        copies[node] = graph.node_copy(node, copies.__getitem__)
    graph.output(copies[mask])
    try:
        with torch.no_grad():
            value = fx.GraphModule(gm, graph)()
    except Exception:  # noqa: BLE001 - an op that cannot run eagerly here: keep the mask, change nothing
        return False
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    if value.dtype == torch.bool:
        allowed = value
    elif value.is_floating_point():
        blocked = torch.isneginf(value) | (value == torch.finfo(value.dtype).min)
        if not bool(((value == 0) | blocked).all()):
            return False  # an additive bias (ALiBi, relative positions): not a mask alone
        allowed = ~blocked
    else:
        return False
    causal = torch.ones(value.shape[-2:], dtype=torch.bool, device=allowed.device).tril()
    return bool(torch.equal(allowed, causal.expand_as(allowed)))


def _erase_unused(graph: fx.Graph, mask: fx.Node) -> None:
    """Remove the mask and what only it used (in reverse order, so users go before their inputs)."""
    for node in reversed(_construction(mask) or []):
        if not node.users and node.op != "placeholder":
            graph.erase_node(node)


def _set(node: fx.Node, name: str, index: int, value) -> None:
    if len(node.args) > index:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


__all__ = ["causal_attention", "is_sdpa"]
