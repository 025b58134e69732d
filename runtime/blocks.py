"""Finding the transformer blocks and the Linear layers inside them that stream.

`find_blocks(model, "auto")` returns the children of every outermost `nn.ModuleList` whose children are repeated
blocks (same class, at least two, each holding a Linear; not necessarily identical), of every such list, in
registration order. The compiler schedules by the order blocks appear in the graph, never by this one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from torch_stagehand.runtime.linear_like import is_conv1d


class BlockSelectionError(ValueError):
    """`blocks=` names nothing usable; the message says what was asked and what exists."""


@dataclass(frozen=True)
class StreamedLayerSpec:
    """One streamed weight: a Linear's (or GPT-2 Conv1D's), or a mixture-of-experts stack.

    An expert stack is a 3-D parameter [E, rows, in] of a module that is not a Linear. It streams as the matrix of
    its E x rows rows (`as_matrix`), so a per-row INT8 scale is per expert and row; the model gets it back in its
    own 3-D shape (`experts/stacks.py`).
    """

    fqn: str  # module FQN relative to the offloaded model (an expert stack: the parameter's FQN)
    block: int  # block index
    module: nn.Module
    out_features: int  # an expert stack: experts x rows
    in_features: int
    # Conv1D keeps its weight as [in, out]; the stream keeps the module's own layout.
    transposed: bool
    param: str = "weight"  # the parameter's name on `module`
    experts: int = 0  # > 0: an expert stack of this many experts

    @property
    def weight(self) -> nn.Parameter:
        """The streamed parameter (after offload: the host master view)."""
        return self.module._parameters[self.param]

    @property
    def weight_name(self) -> str:
        """The parameter's name in a state dict or checkpoint."""
        return self.fqn if self.experts else f"{self.fqn}.weight"

    def as_matrix(self, w):
        """The weight, in the module's own layout, as the [out, in] matrix the host store and quantizers hold."""
        if self.experts:
            return w.reshape(-1, w.shape[-1])
        return w.t() if self.transposed else w

    def stored_view(self, view):
        """A view in the stored orientation (`precision.views(...)[0]`) in the module's own shape."""
        return view.view(self.weight.shape) if self.experts else view


def is_streamable_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and weight.dim() == 2 and (isinstance(module, nn.Linear) or is_conv1d(module))


def _adapter_module_names(module: nn.Module) -> set[str]:
    """Names of peft adapter containers (lora_A, lora_B, ...) on a tuner layer."""
    names = getattr(module, "adapter_layer_names", None)
    if names is None or not hasattr(module, "base_layer"):
        return set()
    return set(names) | set(getattr(module, "other_param_names", ()))


def _has_linear(module: nn.Module) -> bool:
    return any(is_streamable_linear(m) for m in module.modules())


def _repeated_block_lists(model: nn.Module) -> list[str]:
    found: list[str] = []
    for name, module in model.named_modules():
        if any(name == f or name.startswith(f + ".") for f in found):
            continue  # never descend into a list already chosen (e.g. MoE experts inside blocks)
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        classes = {type(child) for child in module}
        if len(classes) == 1 and all(_has_linear(child) for child in module):
            found.append(name)
    return found


def find_blocks(model: nn.Module, blocks: str | list[str] = "auto") -> list[str]:
    """Block FQNs (relative to `model`) in order."""
    modules = dict(model.named_modules())
    if blocks == "auto":
        lists = _repeated_block_lists(model)
        if not lists:
            raise BlockSelectionError(
                f"offload: found no nn.ModuleList of repeated blocks in {type(model).__name__} "
                "(need >= 2 children of one class, each holding an nn.Linear); "
                "pass blocks='<FQN of the block list>' or a list of block FQNs")
        names = lists
    elif isinstance(blocks, str):
        names = [blocks]
    elif isinstance(blocks, (list, tuple)) and blocks and all(isinstance(b, str) for b in blocks):
        names = list(blocks)
    else:
        raise BlockSelectionError(f"offload: blocks must be 'auto', an FQN or a list of FQNs, got {blocks!r}")

    result: list[str] = []
    for name in names:
        module = modules.get(name) if name else None
        is_list = isinstance(module, (nn.ModuleList, nn.Sequential))
        if module is None or (isinstance(blocks, str) and not is_list):
            candidates = ", ".join(_repeated_block_lists(model)) or "none found"
            if module is None:
                raise BlockSelectionError(
                    f"offload: blocks names {name!r}, which is not a submodule of {type(model).__name__} "
                    f"(repeated block lists found: {candidates})")
            raise BlockSelectionError(
                f"offload: blocks={name!r} names a {type(module).__name__}, not a list of repeated blocks "
                f"(an nn.ModuleList or nn.Sequential; found: {candidates}); to stream single modules, "
                f"pass a list of their FQNs: blocks=[{name!r}, ...]")
        children = [f"{name}.{child}" for child, _ in module.named_children()] if is_list else [name]
        for child in children:
            if not _has_linear(modules[child]):
                raise BlockSelectionError(f"offload: block {child!r} holds no nn.Linear; nothing would stream")
            if child in result:
                raise BlockSelectionError(f"offload: block {child!r} is named twice")
            result.append(child)
    for i, a in enumerate(result):
        for b in result[i + 1 :]:
            if a.startswith(b + ".") or b.startswith(a + "."):
                raise BlockSelectionError(f"offload: blocks {a!r} and {b!r} nest; blocks must be disjoint")
    return result


# What a module holding experts calls their count (transformers 5's expert modules: `num_experts`).
EXPERT_COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_stacks(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A module's own 3-D floating parameters whose first dimension is the number of experts the module says it
    holds: stacks of expert matrices, [experts, rows, in] in the module's layout. Found by structure, not by class
    name, so a new MoE family works as it is; a convolution's or an attention's 3-D weight belongs to no module
    that counts experts."""
    if is_streamable_linear(module) or isinstance(module, nn.modules.conv._ConvNd):
        return []
    count = next((v for v in (getattr(module, a, None) for a in EXPERT_COUNT_ATTRS) if isinstance(v, int)), None)
    if count is None or count < 2:
        return []
    return [(name, p) for name, p in module._parameters.items()
            if p is not None and p.dim() == 3 and p.dtype.is_floating_point and p.shape[0] == count]


def streamed_layers(model: nn.Module, block_fqns: list[str]) -> list[StreamedLayerSpec]:
    """Every Linear inside the blocks and every expert stack (`expert_stacks`), except peft adapters (they
    stay resident and trainable)."""
    modules = dict(model.named_modules())
    specs: list[StreamedLayerSpec] = []
    for index, block_fqn in enumerate(block_fqns):
        block = modules[block_fqn]
        skip_prefixes: list[str] = []
        for name, module in block.named_modules():
            if any(name == p or name.startswith(p + ".") for p in skip_prefixes):
                continue
            for adapter in _adapter_module_names(module):
                skip_prefixes.append(f"{name}.{adapter}" if name else adapter)
            fqn = f"{block_fqn}.{name}" if name else block_fqn
            for pname, p in expert_stacks(module):
                specs.append(StreamedLayerSpec(f"{fqn}.{pname}", index, module, int(p.shape[0] * p.shape[1]),
                                               int(p.shape[2]), False, param=pname, experts=int(p.shape[0])))
            if not is_streamable_linear(module):
                continue
            transposed = is_conv1d(module)
            out_f, in_f = (module.weight.shape[1], module.weight.shape[0]) if transposed else module.weight.shape
            specs.append(StreamedLayerSpec(fqn, index, module, int(out_f), int(in_f), transposed))
    return specs


def layout_fingerprint(device_type: str, blocks: list[str], layers) -> str:
    """The model's streamed layout in one name: its blocks and every streamed layer's place and shape (what
    the compile bundle and the kept cost model are of; `layers` have block, fqn, out/in_features)."""
    parts = [device_type, *blocks, *(f"{l.block}:{l.fqn}:{l.out_features}x{l.in_features}"
                                     + (f"/{l.experts}" if getattr(l, "experts", 0) else "") for l in layers)]
    return f"{len(blocks)}blocks-" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


class WrappedAfterOffloadError(RuntimeError):
    """A streamed layer was wrapped after offload (peft adapters) by a module whose parameters are off the device."""


@dataclass(frozen=True)
class LayerSlot:
    """Where a streamed layer sits in the module tree: `parent._modules[name]`."""

    parent: nn.Module
    name: str


def layer_slots(model: nn.Module, specs: list[StreamedLayerSpec]) -> list[LayerSlot]:
    modules = dict(model.named_modules())
    places = [(spec.fqn.rpartition(".")[0] if spec.experts else spec.fqn).rpartition(".") for spec in specs]
    return [LayerSlot(modules[parent], name) for parent, _, name in places]


def _on(where: torch.device, device: torch.device) -> bool:
    """Is a tensor on `where` on `device`? ("cuda" without an index names the current CUDA device.)"""
    if where.type != device.type:
        return False
    if device.index is None and device.type == "cuda":
        return where.index in (None, torch.cuda.current_device())
    return where.index == device.index


def check_not_wrapped_off_device(spec: StreamedLayerSpec, slot: LayerSlot, device) -> None:
    """peft applied after offload puts its adapters where the layer's weight is, the host: right on a CPU stream,
    elsewhere a bare device mismatch inside the adapter, so say which layer and what to do instead."""
    wrapper = slot.parent._modules.get(slot.name)
    if wrapper is spec.module or wrapper is None:
        return
    for pname, p in wrapper.named_parameters():
        if not _on(p.device, torch.device(device)) and not any(p is q for q in spec.module.parameters()):
            raise WrappedAfterOffloadError(
                f"stagehand: streamed layer {spec.fqn} was wrapped by {type(wrapper).__name__} after offload "
                f"(peft adapters?), and its {pname} is on {p.device}, not {device}: apply peft before offload, "
                f"or move the model to {device} after adding adapters (streamed weights stay on the host)")
