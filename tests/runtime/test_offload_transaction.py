"""Offload is a transaction, restore() cleans up, bad set-ups are caught (issue 12).

Rows: a NaN with an int8 map; a slab load that fails; restore() leaving a hook and the
store behind; blocks="embed"; compiling with the backend and no offload; telemetry_file
a directory; peft applied after offload.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import torch_stagehand as stagehand
from torch_stagehand.compiler import backend as backend_module
from torch_stagehand.runtime import registry
from torch_stagehand.runtime.host import arena as host_arena
from torch_stagehand.runtime.host import store as host_store
from torch_stagehand.runtime.device import slots
from torch_stagehand.runtime.blocks import BlockSelectionError
from torch_stagehand.runtime.conductor.telemetry import TelemetryPathError
from torch_stagehand.runtime.slab import SlabError, build_slab_from_module
from torch_stagehand.runtime.streamed import is_streamed

from _helpers import RecordingPinner, assert_exact, toy


def _snapshot(model: nn.Module) -> dict[str, tuple]:
    """Everything a failed offload must leave as it was: values, dtype, device, requires_grad, module classes."""
    state = {name: (t.detach().clone(), t.dtype, t.device, t.requires_grad) for name, t in model.named_parameters()}
    state.update({f"{name}#class": (type(m),) for name, m in model.named_modules()})
    return state


def _assert_untouched(model: nn.Module, before: dict[str, tuple]) -> None:
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for key, value in before.items():
        if key.endswith("#class"):
            assert after[key] == value, key
            continue
        tensor, dtype, device, requires_grad = after[key]
        same = torch.allclose(tensor, value[0], rtol=0, atol=0, equal_nan=True)
        assert same and (dtype, device, requires_grad) == value[1:], key
    assert not any(is_streamed(m) for m in model.modules())
    for module in model.modules():
        assert not module._load_state_dict_post_hooks, "a load_state_dict hook was left behind"
        assert not hasattr(module, "_sh_layer") and "_apply" not in module.__dict__
    for name, p in model.named_parameters():
        assert p._base is None, f"{name} is still a view of a host store buffer"


def _assert_offload_works_again(model: nn.Module, x: torch.Tensor, **kwargs) -> None:
    """After a failed offload the model is offloadable again, and streams the right numbers."""
    expected = copy.deepcopy(model)(x)
    rt = stagehand.offload(model, device="cpu", **kwargs)
    with torch.no_grad():
        assert_exact(model(x), expected)  # measured 0 (CPU, torch 2.13, 3 seeds): the same weights and ops
    rt.restore()


# ---- offload is a transaction ----------------------------------------------------------------------------


def test_nan_with_an_int8_map_names_the_layer_and_leaves_the_model_as_it_was():
    model, x = toy(n=4)
    with torch.no_grad():
        model.blocks[2].down.weight[3, 5] = float("nan")
    before, layer_ids = _snapshot(model), dict(registry._layers)
    with pytest.raises(ValueError, match=r"blocks\.2\.down .*NaN"):
        stagehand.offload(model, device="cpu", precision={3: "int8", 2: "int8"})
    _assert_untouched(model, before)
    assert registry._layers == layer_ids  # the failed runtime registered nothing that outlives it
    # The retry is not "already offloaded"; without the NaN the model offloads and streams.
    with torch.no_grad():
        model.blocks[2].down.weight[3, 5] = 0.0
    _assert_offload_works_again(model, x)
    rt = stagehand.offload(model, device="cpu", precision={2: "int8"})
    assert rt.store.has(2, "int8")
    rt.restore()


def test_a_slab_load_that_fails_on_a_later_block_leaves_every_block_as_it_was(tmp_path):
    source, _ = toy(n=3, d=64)
    result = build_slab_from_module(source, tmp_path, "toy_int8", "toy-v1", include_prefixes=("blocks.0", "blocks.1"),
                                    progress=False, print_report=False, compare_quantizers=False)
    model = copy.deepcopy(source)
    before = _snapshot(model)
    with pytest.raises(SlabError, match=r"blocks\.2"):
        stagehand.offload(model, device="cpu", precision="int8", slab=result.manifest_path)
    _assert_untouched(model, before)


@pytest.mark.parametrize("where", ["host arena", "pinning", "slots"])
def test_out_of_memory_during_offload_leaves_the_model_as_it_was(monkeypatch, where):
    model, x = toy(n=4)
    before = _snapshot(model)
    if where == "host arena":
        def no_room(self, kind, sizes, backing=None):
            raise RuntimeError("simulated: cannot allocate 4 MB")

        monkeypatch.setattr(host_store.HostStore, "_new_arena", no_room)
    elif where == "pinning":  # the third block's range cannot be page-locked
        monkeypatch.setattr(host_arena, "pinner_for", lambda device, pin: RecordingPinner(fail_at=3))
    else:
        def pool(*args, **kwargs):
            raise torch.OutOfMemoryError("simulated: cannot allocate the slots")

        monkeypatch.setattr("torch_stagehand.runtime.conductor.driver.SlotPool", pool)  # the plan driver allocates the pool
    says = {"host arena": r"bf16 copies of blocks 0\.\.3 .* first layer blocks\.0\.up",
            "pinning": r"pin block 2's bf16 copy \(first layer blocks\.2\.up\)", "slots": r"slots of .* MiB"}[where]
    with pytest.raises(torch.OutOfMemoryError, match=says + ".*simulated" + (".*ulimit -l" if where == "pinning" else "")):
        stagehand.offload(model, device="cpu")
    _assert_untouched(model, before)
    monkeypatch.undo()
    _assert_offload_works_again(model, x)


def test_a_failed_offload_keeps_weights_the_user_holds_and_frees_what_it_built(monkeypatch):
    model, _ = toy(n=3)
    held = model.blocks[0].up.weight  # e.g. an optimizer built before offload

    def pool(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr("torch_stagehand.runtime.conductor.driver.SlotPool", pool)  # the plan driver allocates the pool
    stores = []
    real_init = host_store.HostStore.__init__

    def tracked(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        stores.append(weakref.ref(self))

    monkeypatch.setattr(host_store.HostStore, "__init__", tracked)
    with pytest.raises(torch.OutOfMemoryError):
        stagehand.offload(model, device="cpu")
    gc.collect()
    assert model.blocks[0].up.weight is held  # not replaced: the user's reference still names the model's weight
    assert stores and stores[0]() is None  # the host store built for the failed offload is gone


# ---- restore() --------------------------------------------------------------------------------------------


def test_restore_drops_every_hook_and_frees_the_store_and_the_slots():
    model, x = toy(n=4)
    rt = stagehand.offload(model, device="cpu", precision={1: "int8"})
    with torch.no_grad():
        model(x)  # fill the slots
    buffers = [weakref.ref(buf) for bb in rt.store.blocks for buf in bb.buffers.values()]
    buffers += [weakref.ref(slot.buf) for slot in rt.pool.slots]
    store, pool = weakref.ref(rt.store), weakref.ref(rt.pool)
    rt.restore()
    assert rt.restore() is model  # idempotent
    assert all(not m._load_state_dict_post_hooks for m in model.modules())
    model.load_state_dict(copy.deepcopy(model.state_dict()))  # no AttributeError from a stale hook
    del rt
    gc.collect()
    assert store() is None and pool() is None
    assert all(ref() is None for ref in buffers), "a host store or slot buffer outlived restore() and del rt"


def test_a_restored_runtime_refuses_to_be_used():
    model, x = toy(n=3)
    rt = stagehand.offload(model, device="cpu")
    rt.restore()
    with pytest.raises(RuntimeError, match="closed"):
        rt.set_precision("int8")
    with pytest.raises(RuntimeError, match="closed"):
        rt.attach(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    assert rt.stats()["blocks"] == 3  # reading what it did is fine
    # The model is plain again and can be offloaded anew.
    _assert_offload_works_again(model, x)


def test_a_closed_runtime_model_fails_clearly_when_called():
    model, x = toy(n=3)
    rt = stagehand.offload(model, device="cpu")
    rt.close()
    with pytest.raises(RuntimeError, match="no live runtime"), torch.no_grad():
        model(x)
    with pytest.raises(RuntimeError, match="closed"):
        rt.restore()


# ---- set-ups caught at offload / compile ---------------------------------------------------------------


def test_blocks_naming_a_single_module_is_an_error_naming_it():
    model, _ = toy(n=3)
    before = _snapshot(model)
    with pytest.raises(BlockSelectionError, match=r"blocks='embed' names a Linear, not a list of repeated blocks"):
        stagehand.offload(model, device="cpu", blocks="embed")
    _assert_untouched(model, before)
    rt = stagehand.offload(model, device="cpu", blocks=["blocks.0", "blocks.2"])  # single blocks: a list of FQNs
    assert rt.blocks == ["blocks.0", "blocks.2"]
    rt.restore()


def test_compiling_a_model_that_was_never_offloaded_warns_once(monkeypatch):
    monkeypatch.setattr(backend_module, "_warned_not_offloaded", False)
    # Runtimes other tests left alive must not count as offloaded models here.
    monkeypatch.setattr(registry, "_runtimes", weakref.WeakValueDictionary())
    assert not registry.has_runtimes()
    model, x = toy(n=2)
    torch._dynamo.reset()
    with pytest.warns(backend_module.NotOffloadedWarning, match="no model is offloaded"):
        out = torch.compile(model, backend="stagehand", options={"inner": "eager"})(x)
    assert_exact(out, model(x))  # measured 0 (CPU, torch 2.13, 3 seeds)
    other, y = toy(n=2, d=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", backend_module.NotOffloadedWarning)
        torch.compile(other, backend="stagehand", options={"inner": "eager"})(y)  # once per process
    torch._dynamo.reset()


def test_glue_graphs_of_an_offloaded_model_do_not_warn(monkeypatch):
    monkeypatch.setattr(backend_module, "_warned_not_offloaded", False)
    model, x = toy(n=3, graph_break_in=2)  # the break leaves graphs with glue only
    expected = copy.deepcopy(model)(x)
    rt = stagehand.offload(model, device="cpu")
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", backend_module.NotOffloadedWarning)
        with torch.no_grad():
            out = torch.compile(model, backend="stagehand", options={"inner": "eager"})(x)
    assert_exact(out, expected)  # measured 0 (CPU, torch 2.13, 3 seeds)
    rt.restore()
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["directory", "missing folder"])
def test_a_telemetry_file_that_cannot_be_written_fails_at_offload(tmp_path, kind):
    path = tmp_path if kind == "directory" else tmp_path / "no_such_folder" / "t.jsonl"
    model, _ = toy(n=3)
    before = _snapshot(model)
    with pytest.raises(TelemetryPathError, match="telemetry_file"):
        stagehand.offload(model, device="cpu", config=stagehand.Config(telemetry_file=str(path)))
    _assert_untouched(model, before)
    assert not (tmp_path / "no_such_folder").exists()  # nothing created on the way


# ---- peft adapters added after offload --------------------------------------------------------------------


def _lora(model: nn.Module, seed: int = 5) -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"], lora_dropout=0.0,
                             init_lora_weights=False)
    torch.manual_seed(seed)
    return peft.get_peft_model(model, config)


def test_peft_added_after_a_cpu_offload_computes_what_peft_before_offload_computes():
    model, x = toy(n=3)
    reference = _lora(copy.deepcopy(model))
    rt = stagehand.offload(model, device="cpu")
    wrapped = _lora(model)
    expected = reference(x)
    # peft's own ops on the same weights, eagerly and compiled: measured 0 (CPU, torch 2.13, 3 seeds)
    assert_exact(wrapped(x), expected)  # eager
    torch._dynamo.reset()
    out = torch.compile(wrapped, backend="stagehand", options={"inner": "eager"})(x)
    assert_exact(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    lora_grads = [(n, p.grad) for n, p in wrapped.named_parameters() if "lora_" in n]
    reference_grads = dict((n, p.grad) for n, p in reference.named_parameters() if "lora_" in n)
    assert lora_grads
    for n, g in lora_grads:
        assert_exact(g, reference_grads[n], msg=n)  # measured 0
    rt.restore()
    torch._dynamo.reset()


def test_peft_adapters_off_the_device_are_an_error_naming_the_layer():
    # On a CUDA stream peft puts adapters added after offload where the streamed weight is (the host); the
    # CPU stand-in: an adapter left on another device than the stream's.
    model, x = toy(n=3)
    rt = stagehand.offload(model, device="cpu")
    wrapped = _lora(model)
    wrapped.base_model.model.blocks[1].down.lora_B.to("meta")
    with pytest.raises(RuntimeError, match=r"blocks\.1\.down was wrapped by Linear after offload .* on meta, not cpu"):
        wrapped(x)
    rt.close()


def test_a_nan_found_by_set_precision_names_the_layer_and_leaves_no_half_built_copy():
    model, x = toy(n=3)
    rt = stagehand.offload(model, device="cpu")
    with torch.no_grad():
        model.blocks[1].up.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"layer blocks\.1\.up \(block 1\), building its int8 copy.*NaN or Inf"):
        rt.set_precision({0: "int8", 1: "int8"})
    assert rt.precision == {0: "bf16", 1: "bf16", 2: "bf16"} and not rt.store.has(1, "int8")
    with torch.no_grad():
        model.blocks[1].up.weight[0, 0] = 0.0
    rt.set_precision({1: "int8"})  # built now, from the repaired weight
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()
    rt.restore()


# ---- the very Parameter objects -----------------------------------------------------------------------------


def _ids(model: nn.Module) -> dict[str, int]:
    return {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("where", ["pinning", "slots"])
def test_a_failed_offload_keeps_every_parameter_object_and_every_tie(monkeypatch, where):
    """An optimizer or a tie made before the call names the model's weights again after a failure: the same
    objects (no reference held here: the ids alone), their values, the tie between two streamed layers."""
    model, x = toy(n=3)
    model.blocks[2].up.weight = model.blocks[1].up.weight  # one Parameter under two streamed layers
    ids, before = _ids(model), _snapshot(model)
    if where == "pinning":  # after every weight was copied into the host store (and its memory released)
        monkeypatch.setattr(host_arena, "pinner_for", lambda device, pin: RecordingPinner(fail_at=3))
    else:
        def pool(*args, **kwargs):
            raise torch.OutOfMemoryError("simulated: cannot allocate the slots")

        monkeypatch.setattr("torch_stagehand.runtime.conductor.driver.SlotPool", pool)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        stagehand.offload(model, device="cpu")
    assert _ids(model) == ids
    assert model.blocks[2].up.weight is model.blocks[1].up.weight
    _assert_untouched(model, before)
    monkeypatch.undo()
    _assert_offload_works_again(model, x)


def test_offload_releases_the_originals_memory_and_restore_gives_the_same_objects_back():
    """Offload keeps the objects, not two copies of the weights (a weight the user holds is emptied: its values
    live in the host store); restore() fills the same objects with the trained values."""
    from torch_stagehand.optim import HostAdamW

    model, x = toy(n=3)
    held = model.blocks[0].up.weight
    ids = _ids(model)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    assert held.numel() == 0 and held.untyped_storage().nbytes() == 0
    model.requires_grad_(True)
    opt = HostAdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    trained = {f"{s.fqn}.weight": s.module.weight.detach().clone() for s in rt.layers}
    rt.restore()
    assert _ids(model) == ids and model.blocks[0].up.weight is held
    named = dict(model.named_parameters())
    for name, value in trained.items():
        assert torch.equal(named[name].detach(), value), name
        assert type(named[name]) is nn.Parameter and not named[name].requires_grad  # the flag offload saw


def test_a_streamed_weight_tied_to_a_resident_module_keeps_its_memory():
    """Emptying it would break the module outside the blocks that uses it too."""
    model, x = toy(n=3)
    model.spare = nn.Linear(32, 64)  # resident, outside the blocks
    model.spare.weight = model.blocks[0].up.weight
    values = model.spare.weight.detach().clone()
    rt = stagehand.offload(model, device="cpu", verbose=False)
    assert torch.equal(model.spare.weight.detach().cpu(), values)
    rt.close()
