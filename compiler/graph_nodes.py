"""Small FX helpers the passes share: which nodes stream, what a node held when captured, and placeholder plumbing."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

from torch_stagehand.runtime.experts.stacks import EXPERTS_ARGS, STREAMED_EXPERTS_OPS
from torch_stagehand.runtime.ops import STREAMED_LINEAR_OPS


# Node meta key: the node came from the model's own activation checkpoint (inline_checkpoints): the block recomputes.
RECOMPUTE = "stagehand_recompute"


def example_value(node: Any) -> Any:
    """What the node held when Dynamo captured it (its fake value), or None (not a node, or no record)."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def has_static_shape(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(d, int) for d in value.shape)


def is_streamed_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in STREAMED_LINEAR_OPS


def is_streamed_experts(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in STREAMED_EXPERTS_OPS


def is_streamed_read(node: fx.Node) -> bool:
    return is_streamed_linear(node) or is_streamed_experts(node)


def descendants(nodes, skip: fx.Node | None = None) -> set[fx.Node]:
    """`nodes` and every node computed from them (through their users), `skip` left out and not passed."""
    seen, frontier = set(nodes), list(nodes)
    while frontier:
        for user in frontier.pop().users:
            if user not in seen and user is not skip:
                seen.add(user)
                frontier.append(user)
    return seen


def streams(gm: fx.GraphModule) -> fx.Node | None:
    """The first streamed read of this graph or of a subgraph it calls (a checkpoint body), if any."""
    for node in gm.graph.nodes:
        if is_streamed_read(node):
            return node
        if node.op == "get_attr":
            sub = getattr(gm, node.target, None)
            found = streams(sub) if isinstance(sub, fx.GraphModule) else None
            if found is not None:
                return found
    return None


_STREAMED_ARGS = ("x", "bias", "block_tok", "position", "out_features", "anchor")


def node_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def streamed_arg(node: fx.Node, name: str) -> Any:
    """An argument of a captured `streamed_linear(x, bias, block_tok, position, out_features, anchor)` node,
    or of a `streamed_experts(block_tok, position, shape, dtype, device)` node."""
    return node_arg(node, (EXPERTS_ARGS if is_streamed_experts(node) else _STREAMED_ARGS).index(name), name)


def token_owners(gm: fx.GraphModule, example_inputs) -> dict[str, tuple[Any, int]]:
    """`{node name: (runtime, block)}` for the graph's inputs and get_attrs that are block tokens (for fake inputs,
    DDPOptimizer's buckets, by the real value Dynamo captured)."""
    from torch_stagehand.runtime import registry

    owners: dict[str, tuple[Any, int]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        try:
            captured = getattr(node.meta.get("grapharg"), "example", None)
        except Exception:  # a GraphArg whose example was released raises on access
            captured = None
        found = registry.token_owner(value) or registry.token_owner(captured)
        if found is not None:
            owners[node.name] = found
    for node in gm.graph.find_nodes(op="get_attr"):
        found = registry.token_owner(attr_at(gm, node.target))
        if found is not None:
            owners[node.name] = found
    return owners


_ROOT = re.compile(r"^L\[['\"][^'\"]+['\"]\]")
_MODULES_ITEM = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")
# torch 2.13 spells a module reached through a peft wrapper's __dict__: `.__dict__['_modules']['base_model']`
_DICT_MODULES_ITEM = re.compile(r"\.__dict__\[['\"]_modules['\"]\]\[['\"]([^'\"]+)['\"]\]")
_ITEM = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")
_GETATTR = re.compile(r"getattr\(([^()]*), ['\"]([^'\"]+)['\"]\)")


def normalize_module_path(path: str) -> str:
    """`L['self'].layers[0]._modules['mlp']` -> `layers.0.mlp`."""
    previous = None
    while previous != path:
        previous, path = path, _GETATTR.sub(r"\1.\2", path)
    path = _ROOT.sub("", path)
    path = _DICT_MODULES_ITEM.sub(r".\1", path)
    path = _MODULES_ITEM.sub(r".\1", path)
    path = _ITEM.sub(r".\1", path)
    return path.strip(".")


def attr_at(module: fx.GraphModule, target: str) -> Any:
    """What a `get_attr` target (maybe a dotted path) names, or None."""
    try:
        return operator.attrgetter(target)(module)
    except AttributeError:
        return None


def add_placeholder(gm: fx.GraphModule, name: str) -> fx.Node:
    """A new input after the last placeholder."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where = placeholders[-1] if placeholders else next(iter(gm.graph.nodes))
    with (gm.graph.inserting_after(where) if placeholders else gm.graph.inserting_before(where)):
        return gm.graph.placeholder(name)


def find_placeholder(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name)


# Functions and methods that draw random numbers, by name (ATen overloads carry `nondeterministic_seeded` instead).
_RANDOM_CALLS = frozenset({"rrelu", "native_dropout", "rand", "randn", "randint", "rand_like", "randn_like",
                           "randint_like", "randperm", "bernoulli", "multinomial", "normal", "poisson", "bernoulli_",
                           "uniform_", "normal_", "random_", "exponential_", "cauchy_", "geometric_", "log_normal_",
                           "rrelu_"})
# Dropouts `f(input, p, training, ...)` draw nothing when p is 0 or training is off (diffusers' `nn.Dropout(0.0)`).
_DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"})


def _draws_nothing(node: fx.Node, name: str) -> bool:
    """A dropout or attention call whose constant arguments say it draws no random number."""
    if name in _DROPOUTS:
        p, training = node_arg(node, 1, "p", 0.5), node_arg(node, 2, "training", True)
        return (isinstance(p, (int, float)) and p == 0) or training is False
    p = node_arg(node, 4, "dropout_p", 0.0)  # scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, ...)
    return isinstance(p, (int, float)) and p == 0


def draws_random(gm: fx.GraphModule) -> bool:
    """Could running `gm` draw random numbers? (If not, recomputed and kept blocks share one variant.)
    Conservative: an opaque module or subgraph call counts; a dropout or attention unless constants say no."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            return True
        if node.op not in ("call_function", "call_method"):
            continue
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            return True  # a subgraph (checkpoint, invoke_subgraph) not looked into
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            overloads = [target] if isinstance(target, torch._ops.OpOverload) else [
                getattr(target, name) for name in target.overloads()]
            if any(torch.Tag.nondeterministic_seeded in op.tags for op in overloads):
                return True
            continue
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        if name in _RANDOM_CALLS:
            return True
        if (name in _DROPOUTS or name.endswith("scaled_dot_product_attention")) and not _draws_nothing(node, name):
            return True
    return False
