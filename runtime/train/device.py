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
        if self.accumulation_steps != 1:
            return "gradient accumulation sums each backward's gradients on the host"
        if self.states != "fp32":
            return f"states={self.states!r}: the device update keeps fp32 moments"
        if self.master != "fp32" and any(p.dtype != torch.float32 for p in self._streamed):
            return "master='bf16' rounds the weights stochastically on the host"
        return ""

    def _transfer(self, ps: list[torch.Tensor]) -> tuple[int, int]:
        """(H2D, D2H) bytes a step of these weights moves when updated on the device."""
        moved = [transfer_bytes(p.numel(), "master" in self.state[p], p.numel() * p.element_size()) for p in ps]
        return sum(i for i, _ in moved), sum(o for _, o in moved)

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
        largest = max(p.numel() for p in ps)
        if self.device is None or self.device.slots[0].master.numel() < largest:
            self.device = DeviceAdamW(rt.device, largest, ps[0].dtype, rt.grads.stream)
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

    def update_on_device(self, index: int, grad: torch.Tensor, compute) -> tuple:
        """Step layer `index` on the device from `grad`: (grad reusable, host copies written) events, D2H bytes."""
        p = self._param_of[index]
        before = self.device.bytes_out
        consumed, done = self.device.update(p, self.state[p], grad, self._hyper(self._group_of[p]), compute)
        return consumed, done, self.device.bytes_out - before


# ---- AdamW on the GPU: the states come to the gradient

RING = 2  # a slot uploads the next layer's states while the other one is stepped and written back
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def transfer_bytes(numel: int, has_master: bool, weight_bytes: int) -> tuple[int, int]:
    """(H2D, D2H) bytes of one weight updated on the device: states in; states and a separate master's weight out."""
    states = 12 * numel
    return states, states + (weight_bytes if has_master else 0)


def ring_bytes(largest_numel: int, weight_element_size: int) -> int:
    """Device memory of the ring: per slot fp32 master, moments and gradient, and the rounded weight."""
    return RING * largest_numel * (16 + weight_element_size)


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
    """Move these fp32 states into one host arena, page-locked range by range; the caller closes it."""
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
    master: torch.Tensor  # fp32, flat, the largest layer's numel
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor  # the gradient in fp32
    weight: torch.Tensor  # the rounded weight (the weights' dtype)
    step: torch.Tensor  # the kernel's step count (a device scalar, as the fused kernel wants it)
    free: "torch.cuda.Event | None" = None  # its last write-back is done


class DeviceAdamW:
    """The device's update lane: a ring of slots, an upload stream, the gradient lane's D2H stream."""

    def __init__(self, device: torch.device, largest_numel: int, weight_dtype: torch.dtype, stream):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = stream  # the update and its write-back: the gradient lane's D2H stream
        self.upload = torch.cuda.Stream(self.device) if self.cuda else None
        f32 = dict(dtype=torch.float32, device=self.device)
        self.slots = [_Slot(*(torch.empty(largest_numel, **f32) for _ in range(4)),
                            torch.empty(largest_numel, dtype=weight_dtype, device=self.device),
                            torch.zeros((), **f32)) for _ in range(RING)]
        self._next = 0
        self.bytes_in = self.bytes_out = self.layers_updated = 0

    def update(self, param: torch.Tensor, state: dict, grad: torch.Tensor, hyper, compute) -> tuple:
        """AdamW on the device for one weight from `grad`, master (or fp32 weight), moments and weight written back
        to the host: (the event after which `grad` may be reused, the one after the host copies; None on the CPU)."""
        n = param.numel()
        slot = self.slots[self._next]
        self._next = (self._next + 1) % RING
        homes = [state.get("master", param.detach()).view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)]
        on_device = [slot.master[:n], slot.exp_avg[:n], slot.exp_avg_sq[:n]]
        if self.cuda:
            with torch.cuda.stream(self.upload):
                if slot.free is not None:
                    self.upload.wait_event(slot.free)
                for dst, src in zip(on_device, homes):
                    dst.copy_(src, non_blocking=True)
            self.stream.wait_stream(compute)
            self.stream.wait_stream(self.upload)
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            if not self.cuda:
                for dst, src in zip(on_device, homes):
                    dst.copy_(src)
            g32 = slot.grad[:n].copy_(grad.reshape(-1))
            consumed = self.stream.record_event() if self.cuda else None
            slot.step.fill_(float(state["step"]))  # the kernel counts it up and steps with the new count
            hyper.fused_step(on_device[0], g32, on_device[1], on_device[2], slot.step)
            outs = list(zip(homes, on_device))
            if "master" in state:  # the weight that streams, rounded to nearest from the master (as the host does)
                outs.append((param.detach().view(-1), slot.weight[:n].copy_(slot.master[:n])))
            for home, value in outs:
                # Through an alias with a version counter of its own: the block's counter moves when its update
                # is complete (the optimizer's worker, after `done`), never while its backward may still look
                # its slot up (a moved counter there would refetch the block mid-backward).
                _unversioned(home).copy_(value, non_blocking=self.cuda)
            done = self.stream.record_event() if self.cuda else None
        slot.free = done
        state["step"].add_(1)
        self.bytes_in += sum(h.numel() * h.element_size() for h in homes)
        self.bytes_out += sum(h.numel() * h.element_size() for h, _ in outs)
        self.layers_updated += 1
        return consumed, done


def _unversioned(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory as a tensor whose writes do not move `t`'s version counter."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


__all__ = ["DeviceAdamW", "RING", "choose_device_blocks", "pin_states", "ring_bytes", "transfer_bytes"]
