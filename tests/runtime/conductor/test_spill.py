"""Activation spill on a video DiT (issue 59): under a plan that spills, a tiny Wan trained with LoRA computes
the plain model's loss and LoRA gradients, the spilled bytes are counted both ways, and the way back is
prefetched: each spilled block's activations are restored when the backward's schedule names that block (while
the block after it runs its backward), before any of them is read; only the backward's first block reads its own
at use."""

from __future__ import annotations

import copy

import peft
import torch

import torch_stagehand as stagehand
from torch_stagehand.runtime.conductor.costs import CostModel
from torch_stagehand.runtime.device import spill as spill_module

from _helpers import block_bytes_by_precision

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]  # attention and feed-forward
LAYERS = 4


def _tiny_wan_lora():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=LAYERS,
                                  rope_max_seq_len=32)
    model.requires_grad_(False)
    config = peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS, init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(2)
    inputs = {"hidden_states": torch.randn(1, 4, 2, 16, 16, generator=gen),  # 128 video tokens
              "timestep": torch.tensor([500]),
              "encoder_hidden_states": torch.randn(1, 6, 32, generator=gen), "return_dict": False}
    target = torch.randn(1, 4, 2, 16, 16, generator=gen)
    return model, inputs, target


def _step(call, model, inputs, target):
    for p in model.parameters():
        p.grad = None
    loss = (call(**inputs)[0].float() - target).square().mean()  # the flow-matching loss's shape
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _Order:
    """What the spill did, in order: ("pack" | "restore" | "read", block)."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, int]] = []
        cls = spill_module.ActivationSpill
        pack, restore, unpack = cls._pack, cls.restore, cls._unpack

        def logged_pack(spill, t, block):
            packed = pack(spill, t, block)
            if isinstance(packed, spill_module._Spilled):
                self.events.append(("pack", block))
            return packed

        def logged_restore(spill, block, stream):
            self.events.append(("restore", block))
            restore(spill, block, stream)

        def logged_unpack(spill, packed):
            if isinstance(packed, spill_module._Spilled):
                self.events.append(("read", packed.block))
            return unpack(spill, packed)

        monkeypatch.setattr(cls, "_pack", logged_pack)
        monkeypatch.setattr(cls, "restore", logged_restore)
        monkeypatch.setattr(cls, "_unpack", logged_unpack)

    def first(self, kind: str, block: int) -> int:
        return self.events.index((kind, block))

    def last(self, kind: str) -> int:
        return max(i for i, (k, _) in enumerate(self.events) if k == kind)


def test_a_video_dit_whose_plan_spills_trains_as_the_plain_model_and_restores_ahead(monkeypatch):
    # The eager inner compiler: the plain model's own ops, bitwise. The restores are the runtime's, whatever
    # compiles the blocks (a spilling plan under Inductor: test_budget_plan.py; here Inductor measured loss 0,
    # LoRA gradients 5.3e-7 off, for 24 s of CI).
    monkeypatch.setattr(spill_module, "MIN_SPILL_BYTES", 4096)  # the tiny model's activations are small
    model, inputs, target = _tiny_wan_lora()
    plain = copy.deepcopy(model)
    ref_loss, ref_grads = _step(plain, plain, inputs, target)
    assert ref_grads and all("lora_" in n for n in ref_grads)
    block = max(block_bytes_by_precision(model)["bf16"])
    rt = stagehand.offload(model, device="cpu", vram_budget=2 * block + 2**21)
    # Injected constants: 2 MiB of room for activations of 1 MiB a block (a block's own in its backward, and the
    # block before it restored ahead); a spill costs less than a recompute (a slow forward, a fast link), so the
    # first blocks spill and the last two keep theirs.
    rt.replan(CostModel(h2d_bps=1e12, d2h_bps=1e12, forward_s=[1.0] * LAYERS, activation_bytes=[2**20] * LAYERS,
                        input_bytes=[2**16] * LAYERS, frozen=True))
    spilled = rt.plan.spilled
    assert spilled == {0, 1} and rt.plan.restored_ahead == spilled and not rt.plan.recomputed
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    for step in range(2):
        order = _Order(monkeypatch)
        loss, grads = _step(compiled, model, inputs, target)
        assert torch.equal(loss, ref_loss), step
        assert grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), step
        backward_begins = order.last("pack") + 1
        for b in spilled:  # restored in the backward, before any of its tensors is read
            assert backward_begins <= order.first("restore", b) < order.first("read", b), (step, b, order.events)
            if b + 1 in spilled:
                assert order.first("read", b + 1) < order.first("restore", b)  # while block b + 1 ran its backward
    stats = rt.stats()
    assert stats["spilled_blocks"] == len(spilled) and stats["recomputed_blocks"] == 0
    assert stats["d2h_bytes"] > 0 and stats["restored_bytes"] == stats["d2h_bytes"]
    assert stats["restored_ahead_bytes"] == stats["restored_bytes"]  # none came back at use
    rt.close()


def test_the_plans_peak_counts_the_activations_restored_ahead_and_restores_ahead_only_what_fits():
    """While block b runs its backward, block b-1's activations are already back when it is restored ahead: the
    peak counts them (nothing for blocks further back, which stay on the host); a spilled block is restored ahead
    only while the peak that raises still fits, else it comes back at use."""
    from torch_stagehand.runtime.conductor.costs import BlockCost
    from torch_stagehand.runtime.conductor.planner import _restores_ahead, activation_peak

    costs = [BlockCost(bytes=0, forward_s=1.0, activation_bytes=100, input_bytes=10) for _ in range(4)]
    spilled = frozenset(range(4))
    assert activation_peak(costs, set(), frozenset()) == 400  # every block keeps its own
    assert activation_peak(costs, set(), spilled) == 100  # all on the host: each block's own, at its backward
    assert activation_peak(costs, set(), spilled, ahead=frozenset({1})) == 200  # block 2's backward: block 1's too
    assert _restores_ahead(costs, set(), set(), spilled, fixed=0, limit=150) == frozenset()
    assert _restores_ahead(costs, set(), set(), spilled, fixed=0, limit=200) == {0, 1, 2}  # block 3's is read first
    assert _restores_ahead(costs, {1}, set(), spilled, fixed=0, limit=200) == {0, 2}  # a resident block's: at use


def test_a_plan_spills_only_what_the_host_has_room_for():
    """The host's room for spilled activations bounds the spill: with room for one block's 1 MiB, one block spills
    and the others that must give up their activations recompute; the same model with room for all spills all."""
    model, inputs, target = _tiny_wan_lora()
    block = max(block_bytes_by_precision(model)["bf16"])
    rt = stagehand.offload(model, device="cpu", vram_budget=2 * block + 2**21)

    def plan_with(room):
        return rt.replan(CostModel(h2d_bps=1e12, d2h_bps=1e12, forward_s=[1.0] * LAYERS,
                                   activation_bytes=[2**20] * LAYERS, input_bytes=[2**16] * LAYERS,
                                   spill_room_bytes=room, frozen=True))

    everything = plan_with(None)
    assert everything.spilled == {0, 1} and not everything.recomputed
    one = plan_with(2**20 + 2**19)
    assert len(one.spilled) == 1 and len(one.recomputed) >= 1 and not one.spilled & one.recomputed
    assert not one.restored_ahead  # the block after it recomputes: no room left to restore it ahead
    none = plan_with(0)
    assert not none.spilled and len(none.recomputed) >= 2
    rt.close()


def test_the_room_for_spill_is_the_hosts_less_a_quarter_and_counts_the_pooled_buffers(monkeypatch):
    from torch_stagehand.runtime.host import budget as host_budget
    from torch_stagehand.runtime.host.budget import MachineMemory

    GiB = 2**30
    model, inputs, target = _tiny_wan_lora()
    rt = stagehand.offload(model, device="cpu", vram_budget="1GiB")
    driver = rt.plan_driver
    monkeypatch.setattr(host_budget, "probe_machine", lambda: MachineMemory(
        total_bytes=64 * GiB, available_bytes=40 * GiB, cgroup_limit_bytes=32 * GiB, cgroup_used_bytes=16 * GiB))
    assert driver._spill_room() == 12 * GiB  # the cgroup leaves 16 GiB: three quarters of it
    driver.spill = spill_module.ActivationSpill(torch.device("cpu"), pin=False)
    driver.spill.host_bytes = GiB  # buffers it holds already are reused, not allocated again
    assert driver._spill_room() == 13 * GiB
    rt.close()


def test_a_pinned_cap_bounds_the_room_and_the_pooled_buffers_are_not_counted_twice(monkeypatch):
    """Under a pinned cap (Windows, WSL2) the spill may take what the store's locked ranges leave of it; its own
    pooled buffers are pinned by torch outside those ranges, so they are already out of what is left."""
    from torch_stagehand.runtime.host import arena as host_arena
    from torch_stagehand.runtime.host import budget as host_budget
    from torch_stagehand.runtime.host.budget import MachineMemory

    from _helpers import RecordingPinner

    GiB = 2**30
    monkeypatch.setattr(host_arena, "pinner_for", lambda device, pin: RecordingPinner())
    model, _, _ = _tiny_wan_lora()
    rt = stagehand.offload(model, device="cpu", precision="int8", vram_budget="1GiB")
    locked = sum(arena.locked_bytes for arena in rt.store.arenas)
    assert locked > 0
    monkeypatch.setattr(host_budget, "probe_machine", lambda: MachineMemory(
        total_bytes=64 * GiB, available_bytes=40 * GiB, pinned_cap_bytes=8 * GiB, where="wsl"))
    driver = rt.plan_driver
    assert driver._spill_room() == 8 * GiB - locked
    driver.spill = spill_module.ActivationSpill(torch.device("cpu"), pin=False)
    driver.spill.host_bytes = GiB
    assert driver._spill_room() == 8 * GiB - locked
    rt.close()


def test_a_resumed_plan_restores_ahead_as_it_did_and_is_dropped_when_the_host_has_no_room_for_its_spill():
    from torch_stagehand.runtime.conductor import cost_cache

    model, _, _ = _tiny_wan_lora()
    block = max(block_bytes_by_precision(model)["bf16"])
    rt = stagehand.offload(model, device="cpu", vram_budget=2 * block + 2**21)
    costs = CostModel(h2d_bps=1e12, d2h_bps=1e12, forward_s=[1.0] * LAYERS, activation_bytes=[2**20] * LAYERS,
                      input_bytes=[2**16] * LAYERS, frozen=True)
    made = rt.replan(costs)
    assert made.restored_ahead == {0, 1}
    # Restored ahead, a block's H2D per step stays its weights' bytes, as restored at use (the activations are no
    # weight copies), while the step's H2D lane carries them.
    from torch_stagehand.runtime.conductor.planner import build_plan

    block_costs, precision, model_costs = rt.plan_driver._costs()
    at_use = build_plan(block_costs, precision, made.resident, made.recomputed, made.slots, model_costs, "planned",
                        spill=frozenset(made.spilled))
    assert not at_use.restored_ahead and made.blocks != at_use.blocks
    assert [p.h2d_bytes for p in made.blocks] == [p.h2d_bytes for p in at_use.blocks]
    assert sum(end - start for lane, _, start, end in made.timeline() if lane == "h2d") > sum(
        end - start for lane, _, start, end in at_use.timeline() if lane == "h2d")
    decisions = cost_cache.plan_decisions(made, rt.plan_driver.budget)
    assert decisions["ahead"] == [0, 1]
    resumed = cost_cache.resumed_plan(decisions, *rt.plan_driver._costs(), rt.plan_driver.budget)
    assert resumed.restored_ahead == made.restored_ahead and resumed.predicted_peak_bytes == made.predicted_peak_bytes
    rt.plan_driver.cost_model.spill_room_bytes = 2**20  # room for one block's activations, not the two spilled
    assert cost_cache.resumed_plan(decisions, *rt.plan_driver._costs(), rt.plan_driver.budget) is None
    rt.close()
