"""AdamW on the GPU for chosen streamed blocks: the states come to the gradient, not the gradient to the states.

Inside the backward, while a layer's gradient is still in its staging buffer (train/grads.py), its fp32 master and
moments cross PCIe through a ring of `RING` device slots, torch's fused AdamW steps them on the gradient lane's D2H
stream, the weight is rounded from the master (to nearest, as the host does) and everything goes home. The blocks
are chosen from measured costs (`choose_device_blocks`); their host states are page-locked (`pin_states`)."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

from torch_stagehand.environment import env
from torch_stagehand.kernels import adamw as adamw_kernel
from torch_stagehand.runtime.host.arena import HostArena, lock_or_fall_back

log = logging.getLogger("torch_stagehand.optim")

# "auto" chooses the device blocks from the host's time per block in this step: the first one's is no measure
# (its states' and gradient buffers' pages are touched for the first time).
CHOOSE_AFTER_STEPS = 2


class DeviceUpdate:
    """`device_update=`: the blocks HostAdamW steps on the GPU instead of the host."""

    def _device_update_mode(self, device_update, overlapping: bool):
        """"auto", or the set of blocks to update on the device ("off": none); a forced set this configuration
        cannot update there is an error saying why, "auto" keeps it in `device_update_note`."""
        if device_update in ("auto", "off"):
            forced = None
        elif isinstance(device_update, (list, tuple, set, frozenset)) and all(isinstance(b, int)
                                                                               for b in device_update):
            forced = set(device_update)
        else:
            raise ValueError(f"HostAdamW: device_update must be 'auto', 'off' or a list of block indices, got "
                             f"{device_update!r}")
        why = self._device_refusal(forced is not None, overlapping)
        self.device_update_note = why or ("off" if device_update == "off" else "")
        if forced:
            if why:
                raise ValueError(f"HostAdamW: device_update={sorted(forced)}: {why}")
            unknown = forced - set(self._block_params)
            if unknown:
                raise ValueError(f"HostAdamW: device_update names blocks {sorted(unknown)}, which have no streamed "
                                 f"weight in this optimizer (blocks {sorted(self._block_params)})")
            return forced
        return "auto" if device_update == "auto" and not why else set()

    def _device_refusal(self, forced: bool, overlapping: bool) -> str:
        """Why no block can be updated on the device here ('' if one can)."""
        rt = self.runtime
        if rt is None:
            return "no streamed weight"
        if rt.device.type != "cuda" and not forced:
            return "no GPU"
        if not overlapping:
            return "the blocks step after the backward (overlap=False or max_grad_norm), not inside it"
        if rt.grads.shards is not None:
            return "several ranks: each block steps on its owner's host (runtime/train/shards.py)"
        if needs_triton(self.states == "fp32",
                        self.master != "fp32" and any(p.dtype != torch.float32 for p in self._streamed)):
            why = triton_refusal(rt.device)
            if why:
                return f"states={self.states!r}, master={self.master!r}: {why}"
            other = sorted({str(p.dtype) for p in self._streamed} - {"torch.float32", "torch.bfloat16"})
            if other:
                return (f"states={self.states!r}, master={self.master!r}: the device update's kernel steps fp32 or "
                        f"bf16 weights, and streamed weights are {', '.join(other)}")
        return ""

    def _transfer(self, ps: list[torch.Tensor]) -> tuple[int, int]:
        """(H2D, D2H) bytes a step of these weights moves when updated on the device."""
        moved = [transfer_bytes(self.state[p], p.numel() * p.element_size()) for p in ps]
        # with accumulation the earlier backwards' gradient sum goes up too (their D2H is the host path's)
        partial = sum(p.numel() * p.element_size() for p in ps) if self.accumulation_steps > 1 else 0
        return sum(i for i, _ in moved) + partial, sum(o for _, o in moved)

    def _choose_device_blocks(self) -> None:
        """After the second step (every block timed on the host): choose the blocks to step on the device."""
        rt = self.runtime
        h2d = rt.plan_driver.cost_model.h2d_bps
        d2h = rt.plan_driver.cost_model.d2h_bps or h2d
        measured = rt.grads.optimizer_seconds
        host_s, in_s, out_s, grad_s = {}, {}, {}, {}
        for block in self._block_params:
            ps = self._trained(block)
            if ps and block in measured:
                bytes_in, bytes_out = self._transfer(ps)
                host_s[block], in_s[block], out_s[block] = measured[block], bytes_in / h2d, bytes_out / d2h
                grad_s[block] = sum(p.numel() * p.element_size() for p in ps) / d2h
        plan = rt.plan_driver.plan
        resident = plan.resident if plan is not None else set()
        fetch_s = sum(rt.store.nbytes(b, rt.precision[b]) for b in range(len(rt.blocks)) if b not in resident) / h2d
        chosen = choose_device_blocks(host_s, in_s, out_s, grad_s, fetch_s)
        self.device_choice = {
            "blocks": sorted(chosen), "h2d_gbps": round(h2d / 1e9, 1), "d2h_gbps": round(d2h / 1e9, 1),
            "host_only_ms": round(sum(host_s.values()) * 1e3, 1),
            "host_ms": round(sum(v for b, v in host_s.items() if b not in chosen) * 1e3, 1),
            "link_in_ms": round((fetch_s + sum(in_s[b] for b in chosen)) * 1e3, 1),
            "link_out_ms": round((sum(out_s[b] for b in chosen) + sum(grad_s[b] for b in host_s if b not in chosen))
                                 * 1e3, 1)}
        log.info("stagehand HostAdamW: blocks %s step on the device (%s)", sorted(chosen), self.device_choice)
        if chosen:
            self._enable_device(chosen)

    def _enable_device(self, blocks: set[int]) -> None:
        """Blocks `blocks` step on the device from the next backward: states pinned, ring allocated, lane told."""
        rt = self.runtime
        ps = self._trained_in(blocks)
        if not ps:
            return
        self._device_arenas.append(pin_states([self.state[p] for p in ps], rt.store.pinner))
        states = [self.state[p] for p in ps]
        if self.device is None or not self.device.fits(ps, states):
            # (the ring is allocated beside the plan: the peak check after the next step counts it)
            self.device = DeviceAdamW(rt.device, ps, states, rt.grads.stream, self._seed,
                                      accumulates=self.accumulation_steps > 1)
            self.device_choice["ring_mib"] = round(self.device.nbytes / 2**20, 1)
        self.device_blocks |= set(blocks)
        rt.grads.device_updates = {b: self._transfer(self._trained(b)) for b in sorted(self.device_blocks)}

    def _unpin_device_states(self) -> None:
        """Unlock the device blocks' pinned states (the values stay, pageable): restore / close, or a reload."""
        for arena in self._device_arenas:
            arena.close()
        self._device_arenas = []

    def _repin_device_states(self) -> None:
        """After load_state_dict: the device blocks' states are the loaded tensors; pin them again."""
        self._unpin_device_states()
        if self.device_blocks:
            states = [self.state[p] for p in self._trained_in(self.device_blocks)]
            self._device_arenas.append(pin_states(states, self.runtime.store.pinner))

    def _trained_in(self, blocks) -> list[torch.Tensor]:
        return [p for b in sorted(blocks) for p in self._trained(b)]

    # the gradient lane asks, for each trainable layer of the backward that completes a step
    def updates_on_device(self, block: int) -> bool:
        return block in self.device_blocks

    def updated_on_device(self, index: int) -> bool:
        """Was layer `index` stepped on the device in this step (a later gradient of it would be lost)?"""
        return index in self._device_updated

    def update_on_device(self, index: int, grad: torch.Tensor, compute, partial=None) -> tuple:
        """Step layer `index` on the device from `grad` (plus `partial`, the host's sum of the accumulation
        cycle's earlier backwards): (grad reusable, host copies written) events, D2H bytes."""
        p = self._param_of[index]
        self._device_updated.add(index)  # its block's step, on the worker, finishes it (HostAdamW._step_block)
        before = self.device.bytes_out
        consumed, done = self.device.update(p, self.state[p], grad, self._hyper(self._group_of[p]), compute, index,
                                            partial)
        return consumed, done, self.device.bytes_out - before


# ---- AdamW on the GPU: the states come to the gradient

RING = 2  # a slot uploads the next layer's states while the other one is stepped and written back
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def needs_triton(fp32_moments: bool, rounds_weight: bool) -> bool:
    """Whether the device update of this configuration runs the fused Triton kernel (kernels/adamw.py): moments
    other than fp32 are decoded and encoded there, as is a bf16 weight stepped without a master (stochastically
    rounded); fp32 moments with an fp32 master or weight step with torch's fused AdamW."""
    return not fp32_moments or rounds_weight


def triton_refusal(device: torch.device) -> str:
    """Why the fused kernel cannot run on `device` ('' if it can)."""
    if not adamw_kernel.HAS_TRITON:
        return "the device update of these states is a Triton kernel, and Triton does not import"
    if device.type != "cuda" and not env("TRITON_INTERPRET"):
        return "the device update of these states is a Triton kernel: it needs a GPU (or TRITON_INTERPRET=1)"
    return ""


def transfer_bytes(state: dict, weight_bytes: int) -> tuple[int, int]:
    """(H2D, D2H) bytes of one weight updated on the device: its states (moments in their format, scales, master)
    in and out, the weight itself in and out where it has no master, and out beside its master where it has one."""
    stored = sum(state[key].numel() * state[key].element_size() for key in STATE_KEYS if key in state)
    if "master" not in state:
        return stored + weight_bytes, stored + weight_bytes
    return stored, stored + weight_bytes


def choose_device_blocks(host_s: dict[int, float], in_s: dict[int, float], out_s: dict[int, float],
                         grad_s: dict[int, float], backward_fetch_s: float) -> set[int]:
    """The blocks to update on the device: the set that ends the step's optimizer work soonest, the slowest of three
    lanes beside the backward: the host stepping its blocks (`host_s`), the link in (the device blocks' states
    `in_s` beside the weight fetches) and out (`out_s` beside the host blocks' gradients `grad_s`). For each k, k
    device blocks spread evenly over the backward order; the k with the smallest bound wins (the fewest on a tie)."""
    blocks = sorted(host_s)
    best, best_cost = set(), math.inf
    for k in range(len(blocks) + 1):
        chosen = {blocks[int((i + 0.5) * len(blocks) / k)] for i in range(k)} if k else set()
        host = sum(host_s[b] for b in blocks if b not in chosen)
        d2h = sum(out_s[b] for b in chosen) + sum(grad_s[b] for b in blocks if b not in chosen)
        h2d = backward_fetch_s + sum(in_s[b] for b in chosen)
        cost = max(host, d2h, h2d)
        if cost < best_cost - 1e-9:
            best, best_cost = chosen, cost
    return best


def pin_states(states: list[dict], pinner, kind: str = "adamw states") -> HostArena:
    """Move these states (masters, moments, int8 scales) into one host arena, page-locked range by range; the
    caller closes it."""
    tensors = [(st, key) for st in states for key in STATE_KEYS if key in st]
    arena = HostArena(kind, [st[key].numel() * st[key].element_size() for st, key in tensors], pinner)
    for st, key in tensors:
        old = st[key]
        view = arena.carve(old.numel() * old.element_size())
        st[key] = view.view(old.dtype).view(old.shape).copy_(old)
        lock_or_fall_back(arena, view, f"HostAdamW's {key} of a weight updated on the device", refuse=False)
    return arena


@dataclass
class _Slot:
    states: dict[str, torch.Tensor]  # flat, the largest layer's size, each in its host format (STATE_KEYS present)
    grad: torch.Tensor  # the gradient in fp32
    weight: torch.Tensor  # bytes for the weight (in its dtype): stepped without a master, rounded from one
    step: torch.Tensor  # torch's fused kernel's step count (a device scalar, as it wants it)
    partial: torch.Tensor  # bytes for the host's gradient sum of an accumulation cycle's earlier backwards
    free: "torch.cuda.Event | None" = None  # its last write-back is done


class DeviceAdamW:
    """The device's update lane: a ring of slots, an upload stream, the gradient lane's D2H stream. `params` and
    `states`: the weights updated here and their host states, which give every slot's formats and sizes."""

    def __init__(self, device: torch.device, params: list[torch.Tensor], states: list[dict], stream, seed: int,
                 accumulates: bool = False):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = stream  # the update and its write-back: the gradient lane's D2H stream
        self.upload = torch.cuda.Stream(self.device) if self.cuda else None
        self.largest = n = max(p.numel() for p in params)
        self.weight_size = max(p.element_size() for p in params)  # bytes an element of the widest weight stepped
        self.seed = seed  # with each step count and layer, the stochastic rounding's Philox seed (resumes alike)
        self.layout = _state_layout(states)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.slots = [_Slot({key: torch.empty(numel, dtype=dtype, device=self.device)
                             for key, (dtype, numel) in self.layout.items()},
                            torch.empty(n, **f32), torch.empty(self.weight_size * n, dtype=torch.uint8,
                                                               device=self.device),
                            torch.zeros((), **f32),
                            torch.empty(self.weight_size * n if accumulates else 0, dtype=torch.uint8,
                                        device=self.device)) for _ in range(RING)]
        # (without accumulation a host gradient to add is rare, a .grad left from before: made when one comes)
        self.nbytes = sum(t.numel() * t.element_size() for slot in self.slots
                          for t in (*slot.states.values(), slot.grad, slot.weight, slot.step, slot.partial))
        self._next = 0
        self.bytes_in = self.bytes_out = self.layers_updated = 0

    def fits(self, params: list[torch.Tensor], states: list[dict]) -> bool:
        """Whether every slot holds these weights' states and gradients (else a larger ring is made)."""
        return (max(p.numel() for p in params) <= self.largest
                and max(p.element_size() for p in params) <= self.weight_size
                and all(key in self.layout and self.layout[key][0] == dtype and numel <= self.layout[key][1]
                        for key, (dtype, numel) in _state_layout(states).items()))

    def update(self, param: torch.Tensor, state: dict, grad: torch.Tensor, hyper, compute, layer: int,
               partial: torch.Tensor | None = None) -> tuple:
        """AdamW on the device for one weight (streamed layer `layer`) from `grad` (plus `partial`, a host
        gradient sum uploaded with the states), its states and (without a master) the weight written back to the
        host: (the event after which `grad` may be reused, the one after the host copies; None on the CPU)."""
        n = param.numel()
        slot = self.slots[self._next]
        self._next = (self._next + 1) % RING
        weight = param.detach().view(-1)
        stepped_weight = slot.weight[:n * param.element_size()].view(param.dtype)
        keys = [key for key in STATE_KEYS if key in state]
        homes = [state[key].view(-1) for key in keys] + ([] if "master" in state else [weight])
        on_device = [slot.states[key][:state[key].numel()] for key in keys] + \
            ([] if "master" in state else [stepped_weight])
        uploads = list(zip(on_device, homes))
        if partial is not None:  # in, not out
            need = n * partial.element_size()
            if slot.partial.numel() < need:  # once, at its full size: a buffer replaced later could still be read
                slot.partial = torch.empty(max(need, self.weight_size * self.largest), dtype=torch.uint8,
                                           device=self.device)
            uploads.append((slot.partial[:need].view(partial.dtype), partial.reshape(-1)))
        fused = needs_triton(state["exp_avg"].dtype == torch.float32,
                             "master" not in state and param.dtype != torch.float32)
        if self.cuda:
            with torch.cuda.stream(self.upload):
                if slot.free is not None:
                    self.upload.wait_event(slot.free)
                for dst, src in uploads:
                    dst.copy_(src, non_blocking=True)
            self.stream.wait_stream(compute)
            self.stream.wait_stream(self.upload)
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            if not self.cuda:
                for dst, src in uploads:
                    dst.copy_(src)
            g32 = slot.grad[:n].copy_(grad.reshape(-1))
            if partial is not None:
                g32.add_(uploads[-1][0])
            consumed = self.stream.record_event() if self.cuda else None
            outs = list(zip(homes, on_device))
            if fused:  # decode, step and encode in one pass over the states (kernels/adamw.py)
                step = int(state["step"]) + 1
                adamw_kernel.fused_adamw_(stepped_weight, g32, dict(zip(keys, on_device)), hyper.lr, hyper.beta1,
                                          hyper.beta2, hyper.eps, hyper.weight_decay, step,
                                          philox_seed(self.seed, step, layer))
            else:
                slot.step.fill_(float(state["step"]))  # the kernel counts it up and steps with the new count
                stepped = on_device[keys.index("master")] if "master" in state else on_device[-1]
                hyper.fused_step(stepped, g32, *(on_device[keys.index(k)] for k in ("exp_avg", "exp_avg_sq")),
                                 slot.step)
                if "master" in state:  # the weight that streams, rounded to nearest from the master (as the host)
                    stepped_weight.copy_(stepped)
            if "master" in state:
                outs.append((weight, stepped_weight))
            for home, value in outs:
                # Through an alias with a version counter of its own: the block's counter moves when its update
                # is complete (the optimizer's worker, after `done`), never while its backward may still look
                # its slot up (a moved counter there would refetch the block mid-backward).
                _unversioned(home).copy_(value, non_blocking=self.cuda)
            done = self.stream.record_event() if self.cuda else None
        slot.free = done
        state["step"].add_(1)
        self.bytes_in += sum(src.numel() * src.element_size() for _, src in uploads)
        self.bytes_out += sum(h.numel() * h.element_size() for h, _ in outs)
        self.layers_updated += 1
        return consumed, done


def _state_layout(states: list[dict]) -> dict[str, tuple[torch.dtype, int]]:
    """Per state key any of these weights has (a master only where the weight is not fp32): its dtype and the
    largest numel among them."""
    layout: dict[str, tuple[torch.dtype, int]] = {}
    for state in states:
        for key in STATE_KEYS:
            if key in state:
                dtype, numel = layout.get(key, (state[key].dtype, 0))
                layout[key] = (dtype, max(numel, state[key].numel()))
    return layout


def philox_seed(seed: int, step: int, layer: int) -> int:
    """A seed for one layer's stochastic rounding at one step (a 31-bit key: Philox streams of different keys are
    independent), from the optimizer's seed: a resumed run draws the same."""
    return (seed * 1_000_003 + step * 65_537 + layer) % (2**31 - 1)


def _unversioned(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory as a tensor whose writes do not move `t`'s version counter."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


__all__ = ["DeviceAdamW", "RING", "choose_device_blocks", "needs_triton", "philox_seed", "pin_states",
           "transfer_bytes", "triton_refusal"]
