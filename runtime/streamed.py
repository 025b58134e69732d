"""Streamed modules: the same module objects, with a class swapped in.

`offload` changes `module.__class__` from `nn.Linear` (or transformers' `Conv1D`) to a subclass made here, so
`isinstance(m, nn.Linear)` holds, the module tree and FQNs stay, and `restore()` swaps the class back. The subclass
forwards through `stagehand::streamed_linear`, keeps its weight on the host when the model moves, refuses dtype
conversions that would leave the weight behind, and copies a new weight's values into the host master (a
`HostMasterParameter`, a view of the block's flat host buffer whose version counter the slots and copies check).
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn as nn


class StreamedWeightAssignmentError(ValueError):
    """A value that can not become a streamed weight's master (shape, dtype, no values); nothing was changed."""


class StreamedDtypeError(TypeError):
    """A streamed weight's dtype the host store can not hold, or a conversion that would leave it behind."""


class HostMasterParameter(nn.Parameter):
    """A streamed weight: a view of its block's flat host buffer, the master. Every write must move the buffer's
    version counter: in-place ops do, `Tensor.data` would not (a fresh counter), so `.data` is `detach()` (sharing
    it) and assigning `.data` copies the values in."""

    _sh_fqn: str
    _sh_name: str  # the parameter's full name (`<module>.weight`, an expert stack's FQN): what errors say
    _sh_layer: int  # the layer's global id (registry): which runtime and layer it belongs to
    _sh_on_requires_grad = None  # the runtime's callback: the block's grad anchor follows the flag

    # The block's grad anchor (train/grads.py) must follow requires_grad however the flag is set.
    def requires_grad_(self, requires_grad: bool = True):
        super().requires_grad_(requires_grad)
        if self._sh_on_requires_grad is not None:
            self._sh_on_requires_grad()
        return self

    @property
    def requires_grad(self) -> bool:
        return torch._C.TensorBase.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.requires_grad_(value)

    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        copy_into_master(self, value, self._sh_name)

    def module_load(self, other: torch.Tensor, assign: bool = False) -> torch.Tensor:
        # load_state_dict with swap_module_params_on_conversion swaps the parameter with what this returns:
        # another view of the same host bytes, so the swapped-in weight is still the master.
        copy_into_master(self, other, self._sh_name)
        alias = HostMasterParameter(self.detach(), requires_grad=self.requires_grad)
        for name in ("_sh_fqn", "_sh_layer", "_sh_on_requires_grad", "_sh_name"):
            setattr(alias, name, getattr(self, name))
        return alias

    def __repr__(self) -> str:
        return f"Parameter containing (streamed from the host store):\n{self.detach()!r}"


def copy_into_master(master: torch.Tensor, value, name: str) -> None:
    """Write `value` into a streamed weight's host master, or raise naming the parameter and change nothing."""
    if value is master:
        return
    where = f"stagehand: {name} streams from the host store"
    if is_dtensor(value):
        raise ShardedStreamedWeightError(sharded_message(name))
    if not isinstance(value, torch.Tensor):
        raise StreamedWeightAssignmentError(f"{where}; it takes a tensor's values, got {type(value).__name__}")
    if master.is_meta:
        raise StreamedWeightAssignmentError(
            f"{where} as INT8 read from a slab only; it has no full-precision master to write into")
    if value.is_meta:
        raise StreamedWeightAssignmentError(f"{where}; the new value is on the meta device and has no values")
    if value.shape != master.shape:
        raise StreamedWeightAssignmentError(
            f"{where}; the new value has shape {tuple(value.shape)}, the weight {tuple(master.shape)}")
    if value.dtype != master.dtype:
        raise StreamedWeightAssignmentError(
            f"{where} in {master.dtype}; the new value is {value.dtype} (convert it first: value.to({master.dtype}))")
    with torch.no_grad():
        master.detach().copy_(value)  # in place: the version moves, so slot and INT8 copies are refreshed


class ShardedStreamedWeightError(StreamedWeightAssignmentError):
    """FSDP2 sharded a streamed weight (fully_shard without the streamed weights in its ignored_params)."""


def is_dtensor(t) -> bool:
    """A DTensor (FSDP2's sharded parameter); imports nothing (none exists before its module is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def sharded_message(name: str) -> str:
    return (f"stagehand: streamed weight {name} was given to FSDP (fully_shard) after offload: FSDP would keep its "
            "shards on the device, all-gather it at every forward and step its own copy instead of the host master. "
            "Pass fully_shard(..., ignored_params=rt.streamed_parameters()): the blocks stream, FSDP shards the rest")


def refuse_dtype_conversion(fn, modules) -> None:
    """Raise if `fn` (what `Module._apply` maps over tensors) would change a streamed weight's dtype (a `.half()`
    would leave the model in two dtypes); probing `fn` on a 0-dim tensor tells a device move from a conversion."""
    checked: dict[torch.dtype, torch.dtype] = {}
    for module, name in ((m, n) for m in modules for n in m._sh_params):
        dtype = module._parameters[name].dtype
        if dtype not in checked:
            probe = fn(torch.zeros((), dtype=dtype))
            checked[dtype] = probe.dtype if isinstance(probe, torch.Tensor) else dtype
        if checked[dtype] != dtype:
            raise StreamedDtypeError(
                f"stagehand: converting the model to {checked[dtype]} after offload would leave the streamed "
                f"weight {name} of {module._sh_fqn} in {dtype} in the host store (the model would compute in two "
                "dtypes), so nothing was converted; convert before offload(), or rt.restore(), convert and "
                "offload again (moving to a device with .to(device) is fine)"
            )


class _StreamedModule:
    """What the swapped classes share: their `_sh_params` live in the host store, not in the module."""

    _sh_params: tuple[str, ...]
    _sh_layer: int  # global layer id (registry): the layer from Python (a parameter back to its runtime)
    _sh_fqn: str
    _sh_block_tok: torch.Tensor
    _sh_runtime_key: str  # the runtime the layer streams from: what a compiled graph is guarded on
    _sh_copied = "is streamed"  # what `__deepcopy__`'s error says the module does
    _sh_not_deletable = ""  # what `__delattr__`'s error adds

    def _apply(self, fn, recurse=True):
        # Only the other parameters and buffers follow .to()/.cuda(): the streamed ones are host store views.
        # A dtype conversion (.half()) is refused: the bias would follow and the weight not.
        refuse_dtype_conversion(fn, [self])
        order = list(self._parameters)
        streamed = {name: self._parameters.pop(name) for name in self._sh_params}
        try:
            return super()._apply(fn, recurse)
        finally:
            # Back in their places: named_parameters() keeps the model's order (optimizer state follows it).
            self._parameters.update(streamed)
            for name in order:
                self._parameters[name] = self._parameters.pop(name)

    def __setattr__(self, name, value):
        # `module.weight = nn.Parameter(w)` (and load_state_dict(assign=True)) would put a tensor outside the host
        # store that the stream never reads: take its values (and its requires_grad) into the master instead.
        if name in type(self)._sh_params and isinstance(value, nn.Parameter):
            master = self._parameters[name]
            copy_into_master(master, value, f"{self._sh_fqn}.{name}")
            master.requires_grad_(value.requires_grad)
            return
        if name in type(self)._sh_params and value is None:
            raise StreamedWeightAssignmentError(
                f"stagehand: {self._sh_fqn}.{name} streams from the host store and can not be set to None; "
                "call restore() on the Runtime first")
        super().__setattr__(name, value)  # a plain tensor: nn.Module's own TypeError

    def __delattr__(self, name):
        if name in type(self)._sh_params:
            raise StreamedWeightAssignmentError(
                f"stagehand: {self._sh_fqn}.{name} streams from the host store and can not be deleted"
                f"{self._sh_not_deletable}; call restore() on the Runtime first")
        super().__delattr__(name)

    def __deepcopy__(self, memo):
        # A copy would alias the original's host store and slots through the layer id.
        raise TypeError(
            f"stagehand: {self._sh_fqn} {self._sh_copied}; deepcopy the model before offload() or after restore()")


class StreamedMixin(_StreamedModule):
    _sh_params = ("weight",)
    _sh_anchor: torch.Tensor  # the block's grad anchor (train/grads.py)
    # What forward hands the op besides the block's token (a plain tensor attribute: a graph input guarded by
    # its metadata): the layer's position in the block and its width, the same in every block of a structure,
    # so one Dynamo graph serves them all (registry.py).
    _sh_position: int
    _sh_out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            guard_on_runtime(self._sh_runtime_key)
        return torch.ops.stagehand.streamed_linear(x, self.bias, self._sh_block_tok, self._sh_position,
                                                   self._sh_out_features, self._sh_anchor)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, streamed (layer {self._sh_layer})"


_SUBCLASSES: dict = {}


def streamed_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Streamed{cls.__name__}", (StreamedMixin, cls), {"_sh_original_class": cls})
    return _SUBCLASSES[cls]


def runtime_key(runtime_id: int) -> str:
    return f"runtime {runtime_id}"


def guard_on_runtime(key: str) -> None:
    """Make the graph being captured specific to one offloaded runtime: it bakes in its runtime (precisions,
    schedule, plan), but the block tokens are guarded by their metadata only. Dynamo guards a string attribute by
    its value once a branch reads it: this branch is that read (the key is never empty)."""
    if not key:
        raise RuntimeError("stagehand: a streamed layer without its runtime's key")


def make_streamed(module: nn.Module, layer_id: int, fqn: str, anchor: torch.Tensor, on_requires_grad,
                  block_tok: torch.Tensor, position: int, out_features: int, runtime_id: int) -> None:
    """`anchor`: the block's grad anchor; `on_requires_grad()`: called when the weight's flag changes; `position`:
    the layer's place among its block's streamed layers; `runtime_id`: the registry id (`guard_on_runtime`)."""
    module.__class__ = streamed_class(type(module))
    module._sh_layer, module._sh_runtime_key, module._sh_fqn, module._sh_anchor = (
        layer_id, runtime_key(runtime_id), fqn, anchor)
    module._sh_block_tok, module._sh_position, module._sh_out_features = block_tok, position, out_features
    weight = module._parameters["weight"]
    weight.__class__ = HostMasterParameter
    weight._sh_fqn, weight._sh_layer, weight._sh_name, weight._sh_on_requires_grad = (
        fqn, layer_id, f"{fqn}.weight", on_requires_grad)


def guard_conversions(model: nn.Module, streamed_fqns: list[str]) -> list[nn.Module]:
    """Check dtype conversions at every ancestor of a streamed layer, before anything converts (`model.half()`
    converts children first: a streamed module's own check would come too late). Returns them for `unguard`."""
    names = {""}
    for parts in (fqn.split(".") for fqn in streamed_fqns):
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    guarded = [model.get_submodule(name) for name in sorted(names)]
    for module in guarded:
        module.__dict__["_apply"] = types.MethodType(_guarded_apply, module)
    return guarded


def unguard(modules: list[nn.Module]) -> None:
    for module in modules:
        module.__dict__.pop("_apply", None)


def _guarded_apply(module: nn.Module, fn, recurse: bool = True):
    refuse_dtype_conversion(fn, [m for m in module.modules() if is_streamed(m)])
    return type(module)._apply(module, fn, recurse)


_STREAMED_ATTRS = ("_sh_layer", "_sh_runtime_key", "_sh_fqn", "_sh_anchor", "_sh_block_tok", "_sh_position",
                   "_sh_out_features", "_sh_stacks", "_sh_trains", "_sh_device", "_sh_lora", "_sh_routed", "_sh_reads")


def make_plain(module: nn.Module) -> None:
    """The module's own class again (idempotent: an expert module is one module for several streamed layers)."""
    if not is_streamed(module):
        return
    module.__class__ = module._sh_original_class
    for name in _STREAMED_ATTRS:
        module.__dict__.pop(name, None)


def is_streamed(module: nn.Module) -> bool:
    return isinstance(module, _StreamedModule)


class StreamedExpertsMixin(_StreamedModule):
    """A module holding expert stacks (3-D parameters: blocks.expert_stacks) that stream: they stay in `_parameters`
    as host master views, each shadowed by a property reading `stagehand::streamed_experts` (experts/stacks.py)."""

    _sh_stacks: dict[str, tuple[int, tuple[int, ...], torch.dtype]]  # name -> (position in the block, shape, dtype)
    _sh_trains: dict[str, bool]  # name -> requires_grad, kept by the parameter's callback (no parameter read)
    _sh_device: torch.device
    _sh_copied = "streams its experts"
    _sh_not_deletable = " or parametrized (peft's target_parameters: apply peft before offload())"

    def forward(self, *args, **kwargs):
        # Eagerly, the router's choice (the one integer tensor the experts get) goes to the stacks' property:
        # a few tokens' forward copies only the experts picked (eager_path.py). Compiled, the block reads all.
        if torch.compiler.is_compiling():
            return super().forward(*args, **kwargs)
        self.__dict__["_sh_routed"] = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                                            and a.dtype in (torch.int32, torch.int64) and a.dim() >= 1), None)
        # Each stack read once a forward (a loop over the experts reads it often); the hidden states are the
        # next block's router input for the expert cache's guess (experts/cache.py).
        hidden = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()
                       and a.dim() >= 2), None)
        self.__dict__["_sh_reads"] = {("hidden",): hidden}
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.__dict__.pop("_sh_routed", None)
            self.__dict__.pop("_sh_reads", None)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, experts streamed ({', '.join(self._sh_params)})"


def streamed_experts_class(cls: type, names: tuple[str, ...], getter) -> type:
    """The swapped class for a module class and its streamed stacks: `getter(module, name)` is each
    stack's property (experts/stacks.py)."""
    key = (cls, names)
    if key not in _SUBCLASSES:
        props = {name: property(lambda self, _n=name: getter(self, _n)) for name in names}
        _SUBCLASSES[key] = type(f"Streamed{cls.__name__}", (StreamedExpertsMixin, cls),
                                {"_sh_original_class": cls, "_sh_params": names, **props})
    return _SUBCLASSES[key]
