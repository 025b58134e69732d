"""Streamed Linear modules: the same module objects, with a class swapped in.

`offload` changes `module.__class__` from `nn.Linear` (or transformers'
`Conv1D`) to a subclass made here, so `isinstance(m, nn.Linear)` still holds
(peft, HF and diffusers code keeps working), the module tree and FQNs stay the
same, and `restore()` swaps the class back. The subclass:

* forwards through `stagehand::streamed_linear`, the op the backend rewrites;
* keeps its weight on the host when the model is moved (`_apply` touches only
  the bias and buffers), like SquareQ's dtype protection;
* hands its block's grad anchor to the op, so a weight that requires grad gets
  its gradient in backward, landed in a host buffer (train/grads.py): the host copy
  is the master, and any optimizer over `model.parameters()` steps it;
* refuses `.half()` / `.to(dtype)` and the like, which would convert its bias
  but not its weight (`refuse_dtype_conversion`; `guard_conversions` installs
  the same check on its ancestors, so `model.half()` refuses before anything
  is converted);
* takes a new weight (`module.weight = nn.Parameter(...)`, and so
  `load_state_dict(assign=True)`) by copying its values into the host master.

Its weight is a `HostMasterParameter`: a view of the block's flat host buffer
whose in-place writes, `.data` writes included, bump that buffer's version
counter, which the slot pool and the derived (INT8) copies compare against
before they serve the block again.
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
    """A streamed weight: a view of its block's flat host buffer, the master copy of the weight.

    Every write to it must move the buffer's version counter, the one thing the
    slots and the derived copies check (an int compare per block fetch or slot
    hit). In-place ops do; `Tensor.data` would not (it hands out a tensor with a
    fresh counter), so here `.data` is `detach()`, which shares the counter, and
    assigning `.data` copies the values in (the master must stay in the buffer).
    """

    _sh_fqn: str
    _sh_name: str  # the parameter's full name (`<module>.weight`, an expert stack's FQN): what errors say
    _sh_layer: int  # the layer's global id (registry): which runtime and layer it belongs to
    _sh_on_requires_grad = None  # the runtime's callback: the block's grad anchor follows the flag

    # requires_grad decides whether the weight gets a gradient in backward: the block's grad anchor
    # (train/grads.py) must follow it, however the flag is set (`requires_grad_`, `model.requires_grad_()`,
    # or assignment).
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
        # load_state_dict under torch.__future__.set_swap_module_params_on_conversion(True) swaps
        # the parameter with what this returns: copy the values in and return another view of the
        # same host bytes, so the swapped-in weight is still the master.
        copy_into_master(self, other, self._sh_name)
        alias = HostMasterParameter(self.detach(), requires_grad=self.requires_grad)
        alias._sh_fqn, alias._sh_layer, alias._sh_on_requires_grad = self._sh_fqn, self._sh_layer, self._sh_on_requires_grad
        alias._sh_name = self._sh_name
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
        # An in-place write: the buffer's version moves, so the block's slot copy and its
        # INT8 copy are refreshed before the next call reads them.
        master.detach().copy_(value)


class ShardedStreamedWeightError(StreamedWeightAssignmentError):
    """FSDP2 sharded a streamed weight (fully_shard without the streamed weights in its ignored_params)."""


def is_dtensor(t) -> bool:
    """A DTensor (FSDP2's sharded parameter): only once its module is imported can one exist, so this imports
    nothing (the DTensor package costs a second to load)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def sharded_message(name: str) -> str:
    return (f"stagehand: streamed weight {name} was given to FSDP (fully_shard) after offload: FSDP would keep its "
            "shards on the device, all-gather it at every forward and step its own copy instead of the host master. "
            "Pass fully_shard(..., ignored_params=rt.streamed_parameters()): the blocks stream, FSDP shards the rest")


def refuse_dtype_conversion(fn, modules) -> None:
    """Raise if `fn` (what `Module._apply` maps over tensors) would change a streamed weight's dtype.

    The weights stay in the host store when a model is converted (only biases
    and buffers follow), so a `.half()` would leave the model computing in two
    dtypes. Probing `fn` on a 0-dim tensor of each weight's dtype tells a device
    move (fine) from a dtype conversion (refused) before anything is converted.
    """
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


class StreamedMixin:
    _sh_params = ("weight",)  # the parameters that stream (their values live in the host store)
    _sh_layer: int  # global layer id (registry): the layer from Python (a parameter back to its runtime)
    _sh_fqn: str
    _sh_anchor: torch.Tensor  # the block's grad anchor (train/grads.py)
    # What forward hands the op: the block's token (a plain tensor attribute, so Dynamo makes it a graph
    # input guarded by its metadata), the layer's position in the block and its width. All three are the
    # same in every block of a structure, so one Dynamo graph serves them all (registry.py).
    _sh_block_tok: torch.Tensor
    _sh_position: int
    _sh_out_features: int
    _sh_runtime_key: str  # the runtime the layer streams from: what a compiled graph is guarded on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            guard_on_runtime(self._sh_runtime_key)
        return torch.ops.stagehand.streamed_linear(x, self.bias, self._sh_block_tok, self._sh_position,
                                                   self._sh_out_features, self._sh_anchor)

    def _apply(self, fn, recurse=True):
        # Only the bias and buffers follow .to()/.cuda(): the weight is the host store's
        # view, and converting it would silently duplicate or corrupt it. A dtype
        # conversion (.half()) is refused: the bias would follow and the weight not.
        refuse_dtype_conversion(fn, [self])
        order = list(self._parameters)
        weight = self._parameters.pop("weight")
        try:
            return super()._apply(fn, recurse)
        finally:
            # Back in its place: named_parameters() keeps the model's order (optimizer state follows it).
            self._parameters["weight"] = weight
            for name in order:
                self._parameters[name] = self._parameters.pop(name)

    def __setattr__(self, name, value):
        # `module.weight = nn.Parameter(w)` (and load_state_dict(assign=True), which does the
        # same) would put a tensor outside the host store that the stream never reads: take
        # its values into the master instead (and its requires_grad, which forward checks).
        if name == "weight" and isinstance(value, nn.Parameter):
            master = self._parameters["weight"]
            copy_into_master(master, value, f"{self._sh_fqn}.weight")
            master.requires_grad_(value.requires_grad)
            return
        if name == "weight" and value is None:
            raise StreamedWeightAssignmentError(
                f"stagehand: {self._sh_fqn}.weight streams from the host store and can not be set to None; "
                "call restore() on the Runtime first")
        super().__setattr__(name, value)  # a plain tensor: nn.Module's own TypeError

    def __delattr__(self, name):
        if name == "weight":
            raise StreamedWeightAssignmentError(
                f"stagehand: {self._sh_fqn}.weight streams from the host store and can not be deleted; "
                "call restore() on the Runtime first")
        super().__delattr__(name)

    def __deepcopy__(self, memo):
        # A copy would alias the original's host store and slots through the layer id.
        raise TypeError(
            f"stagehand: {self._sh_fqn} is streamed; deepcopy the model before offload() or after restore()"
        )

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
    """Make the graph being captured specific to one offloaded runtime.

    A compiled graph bakes in its runtime: the precision of each block's ops, the schedule, the plan. The block
    tokens are graph inputs guarded by their metadata only (so identical blocks share a graph), so without more a
    second model of the same architecture offloaded in the same process, or the same model offloaded again with
    another precision, would pass Dynamo's guards and run the first runtime's graph. Dynamo guards a string
    attribute of a module by its value (a string never becomes symbolic, as an int may), but only once a branch
    reads it: this branch is that read, so a graph captured for one runtime fails its guards for the next and
    Dynamo captures a graph of its own. The key is never empty; the branch is there for its guard."""
    if not key:
        raise RuntimeError("stagehand: a streamed layer without its runtime's key")


def make_streamed(module: nn.Module, layer_id: int, fqn: str, anchor: torch.Tensor, on_requires_grad,
                  block_tok: torch.Tensor, position: int, out_features: int, runtime_id: int) -> None:
    """`anchor`: the block's grad anchor; `on_requires_grad()`: called when the weight's flag changes;
    `block_tok`, `position`: the block's token and the layer's place among its streamed layers; `runtime_id`: the
    runtime's registry id (`guard_on_runtime`)."""
    module.__class__ = streamed_class(type(module))
    module._sh_layer, module._sh_runtime_key = layer_id, runtime_key(runtime_id)
    module._sh_fqn = fqn
    module._sh_anchor = anchor
    module._sh_block_tok, module._sh_position, module._sh_out_features = block_tok, position, out_features
    weight = module._parameters["weight"]
    weight.__class__ = HostMasterParameter
    weight._sh_fqn, weight._sh_layer, weight._sh_name = fqn, layer_id, f"{fqn}.weight"
    weight._sh_on_requires_grad = on_requires_grad


def guard_conversions(model: nn.Module, streamed_fqns: list[str]) -> list[nn.Module]:
    """Check dtype conversions at every ancestor of a streamed layer, before anything converts.

    `model.half()` converts children first, so the check in a streamed
    module's own `_apply` would come after the modules before it were
    converted. An instance `_apply` on each ancestor runs the check over all
    its streamed descendants first. Returns the guarded modules (`unguard`).
    """
    names = {fqn.rsplit(".", 1)[0] if "." in fqn else "" for fqn in streamed_fqns}
    for fqn in list(names):
        while "." in fqn:
            fqn = fqn.rsplit(".", 1)[0]
            names.add(fqn)
    names.add("")
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


_STREAMED_ATTRS = ("_sh_layer", "_sh_runtime_key", "_sh_fqn", "_sh_anchor", "_sh_block_tok", "_sh_position", "_sh_out_features",
                   "_sh_stacks", "_sh_trains", "_sh_device", "_sh_lora", "_sh_routed", "_sh_reads")


def make_plain(module: nn.Module) -> None:
    """The module's own class again (idempotent: an expert module is one module for several streamed layers)."""
    if not is_streamed(module):
        return
    module.__class__ = module._sh_original_class
    for name in _STREAMED_ATTRS:
        module.__dict__.pop(name, None)


def is_streamed(module: nn.Module) -> bool:
    return isinstance(module, (StreamedMixin, StreamedExpertsMixin))


class StreamedExpertsMixin:
    """A module holding expert stacks (3-D parameters: blocks.expert_stacks) that stream.

    The stacks stay in `_parameters` as host master views (state_dict, optimizers and load_state_dict see
    the real weights), and a property of the same name on the swapped class shadows each for attribute
    access: `self.gate_up_proj` in the model's own forward (its grouped-GEMM, batched or looped
    implementation) reads `stagehand::streamed_experts`, the stack on the device in the module's dtype and
    shape (experts/stacks.py). Dynamo captures that op, and the backend rewrites it into a view of the block's slot.
    Only the stacks are taken from `.to()`; the module's other parameters (expert biases) move as usual.
    """

    _sh_params: tuple[str, ...]
    _sh_layer: int
    _sh_fqn: str
    _sh_block_tok: torch.Tensor
    _sh_runtime_key: str  # guard_on_runtime
    _sh_stacks: dict[str, tuple[int, tuple[int, ...], torch.dtype]]  # name -> (position in the block, shape, dtype)
    _sh_trains: dict[str, bool]  # name -> requires_grad, kept by the parameter's callback (no parameter read)
    _sh_device: torch.device

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

    def _apply(self, fn, recurse=True):
        refuse_dtype_conversion(fn, [self])
        order = list(self._parameters)
        stacks = {name: self._parameters.pop(name) for name in self._sh_params}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters.update(stacks)
            for name in order:
                self._parameters[name] = self._parameters.pop(name)

    def __setattr__(self, name, value):
        if name in type(self)._sh_params and isinstance(value, nn.Parameter):
            master = self._parameters[name]
            copy_into_master(master, value, f"{self._sh_fqn}.{name}")
            master.requires_grad_(value.requires_grad)
            return
        if name in type(self)._sh_params and value is None:
            raise StreamedWeightAssignmentError(
                f"stagehand: {self._sh_fqn}.{name} streams from the host store and can not be set to None; "
                "call restore() on the Runtime first")
        super().__setattr__(name, value)

    def __delattr__(self, name):
        if name in type(self)._sh_params:
            raise StreamedWeightAssignmentError(
                f"stagehand: {self._sh_fqn}.{name} streams from the host store and can not be deleted or "
                "parametrized (peft's target_parameters: apply peft before offload()); call restore() on the "
                "Runtime first")
        super().__delattr__(name)

    def __deepcopy__(self, memo):
        raise TypeError(
            f"stagehand: {self._sh_fqn} streams its experts; deepcopy the model before offload() or after restore()")

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
