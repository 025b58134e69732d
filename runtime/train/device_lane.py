"""HostAdamW's updates on the GPU (runtime/train/device.py): which blocks, and the lane the gradients are handed to.

A mixin of `HostAdamW` (train/optimizer.py), kept apart so each file reads as
one job: this one decides where a block's update runs and drives the device
lane; the optimizer itself owns the states and the host path.
"""

from __future__ import annotations

import logging

import torch

from torch_stagehand.runtime.train.device import DeviceAdamW, choose_device_blocks, pin_states, transfer_bytes

log = logging.getLogger("torch_stagehand.optim")

# "auto" chooses the device blocks from the host's time per block in this step: the first one's is no measure
# (its states' and gradient buffers' pages are touched for the first time: on an H100 host, 1.5-3.8x the next).
CHOOSE_AFTER_STEPS = 2


class DeviceUpdate:
    """`device_update=`: the blocks HostAdamW steps on the GPU instead of the host."""

    def _device_update_mode(self, device_update, overlapping: bool):
        """"auto", or the set of blocks to update on the device ("off": none); a forced set this configuration
        cannot update there is an error that says why; "auto" keeps the reason in `device_update_note`."""
        if device_update in ("auto", "off"):
            forced = None
        elif isinstance(device_update, (list, tuple, set, frozenset)) and all(isinstance(b, int) for b in device_update):
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
        """After the second step (every block stepped on the host, each timed): the blocks whose update moves
        to the device, from the host's measured time per block and the link's measured bandwidths."""
        rt = self.runtime
        model = rt.planner.cost_model
        h2d = model.h2d_bps
        d2h = model.d2h_bps or h2d
        measured = rt.grads.optimizer_seconds
        host_s, in_s, out_s, grad_s = {}, {}, {}, {}
        for block in self._block_params:
            ps = self._trained(block)
            if ps and block in measured:
                bytes_in, bytes_out = self._transfer(ps)
                host_s[block], in_s[block], out_s[block] = measured[block], bytes_in / h2d, bytes_out / d2h
                grad_s[block] = sum(p.numel() * p.element_size() for p in ps) / d2h
        plan = rt.planner.plan
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
        """Blocks `blocks` step on the device from the next backward: their states pinned, the ring allocated,
        the gradient lane routing their layers to it and the planner counting their bytes."""
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
        """Step layer `index` on the device from `grad` (a device tensor in the weight's stored orientation):
        (the event after which `grad` may be reused, the event after which the host copies are written,
        the bytes sent D2H)."""
        p = self._param_of[index]
        before = self.device.bytes_out
        consumed, done = self.device.update(p, self.state[p], grad, self._hyper(self._group_of[p]), compute)
        return consumed, done, self.device.bytes_out - before

