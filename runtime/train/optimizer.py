"""`HostAdamW`: the optimizer for full fine-tuning of an offloaded model (its stepping lanes: train/host.py,
train/device.py, train/delayed.py)."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import defaultdict

import torch

from torch_stagehand.runtime import registry
from torch_stagehand.runtime.train.delayed import DelayedStep, DelayedUpdate
from torch_stagehand.runtime.train.device import CHOOSE_AFTER_STEPS, DeviceAdamW, DeviceUpdate
from torch_stagehand.runtime.telemetry.events import progress
from torch_stagehand.runtime.host.budget import gib, probe_machine
from torch_stagehand.runtime.device.allocator import allocated_bytes
from torch_stagehand.runtime.train.host import (MASTERS, RESIDENT_PLACES, STATE_BYTES, STATES, Hyper, LandingWorker,
                                                 ResidentAdamW, Scratch, adamw_step, local_shard, new_state,
                                                 state_bytes)
from torch_stagehand.runtime.host.plan import HostMemoryError
from torch_stagehand.runtime.streamed import HostMasterParameter

log = logging.getLogger("torch_stagehand.optim")  # the public name (torch_stagehand.optim)


class HostUpdateWarning(UserWarning):
    """HostAdamW keeps work on the host that could run on the GPU (device_update="auto"), or the resident
    parameters' states on the host (resident_states="auto"): the message says why."""


class HostAdamW(DeviceUpdate, DelayedStep, torch.optim.Optimizer):
    """AdamW for full fine-tuning of an offloaded model, in place of `torch.optim.AdamW`.

        rt = stagehand.offload(model, device="cuda", vram_budget="24GiB")   # weights keep requires_grad=True
        opt = stagehand.optim.HostAdamW(model.parameters(), lr=1e-5)
        loss = compiled(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()

    A streamed block steps on the host as soon as its gradients have landed, overlapped with the backward of the
    blocks before it; every other parameter (embeddings, heads, norms, biases, LoRA adapters) steps in `step()` with
    the same master and moments. The update is AdamW's (any torch optimizer trains streamed weights too: their
    `.grad` is a host tensor after the backward; this one overlaps). A host too small for the states is a
    `HostMemoryError` naming the bytes per component, before anything is allocated.

    Args:
        lr: the learning rate.
        betas: the decay rates of the two moments.
        eps: added to the second moment's square root in the denominator.
        weight_decay: decoupled weight decay, as AdamW's.
        master: "fp32" (default): an fp32 master and fp32 moments per weight, 12 bytes a parameter, the bf16 copy
            rounded from the master after each step. "bf16": the bf16 weight is its own master, updated with
            stochastic rounding (8 bytes a parameter).
        states: "fp32" (default), "bf16" or "int8": the moments' bytes, 8, 4 or 2 a parameter (the smaller ones
            stochastically rounded, at a host-time cost); with master="bf16", "int8" is 2 bytes beside the weight.
        overlap: False steps every block in `step()`, after the backward.
        accumulation_steps: `step()` is called after every k backwards; the blocks step during the k-th (another
            cadence is an error at `step()`).
        max_grad_norm: clip by the global norm of every gradient, streamed and resident (overlap then waits for the
            whole backward); not `torch.nn.utils.clip_grad_norm_`, which misses the streamed ones under overlap.
        seed: of the stochastic rounding's random stream, kept in `state_dict()` (a resumed run rounds the same).
        device_update: "auto" (default): some blocks step on the GPU inside the backward, their master and
            moments streamed in and out beside the weights in their own format (int8 / bf16 moments and a bf16
            weight without master decoded, stepped and encoded by one Triton kernel, with stochastic rounding),
            chosen after the second step from the measured host time per block and link bandwidths; a list of
            blocks forces them; "off" keeps every block on the host. It needs `overlap` and no `max_grad_norm`
            (`device_update_note` says why "auto" stays on the host); with `accumulation_steps` the earlier
            backwards' gradients land on the host and their sum goes up with the states in the last one.
        delayed_update: True: ZeRO-Offload's one-step-delayed update, which changes the math: step t's update runs
            beside step t+1, its weights first used by step t+2 (resident parameters step exactly), with an fp32
            master of every streamed weight and a second set of host gradient buffers; `flush()` (called by
            `state_dict()`) publishes the pending update.
        resident_states: where the resident parameters' masters and moments live. "device": beside them (the VRAM
            plan counts them); "host": page-locked, each gradient copied down once final and stepped during the
            backward (after it with accumulation, clipping or several ranks), the weights copied up in `step()`;
            "auto" (default): in the model's order, on the device while they take at most half of what the VRAM
            budget leaves beside the resident tensors and two slots of the largest block, the rest on the host.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, master: str = "fp32", states: str = "fp32", overlap: bool = True,
                 accumulation_steps: int = 1, max_grad_norm: float | None = None, seed: int = 0,
                 device_update="auto", delayed_update: bool = False, resident_states: str = "auto"):
        for name, value, known in (("master", master, MASTERS), ("states", states, STATES),
                                   ("resident_states", resident_states, RESIDENT_PLACES)):
            if value not in known:
                raise ValueError(f"HostAdamW: {name} must be one of {known}, got {value!r}")
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"HostAdamW: accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master, self.states = master, states
        self.max_grad_norm, self.accumulation_steps = max_grad_norm, accumulation_steps
        self._delayed_update = delayed_update
        if delayed_update and master != "fp32":
            raise ValueError("HostAdamW: delayed_update=True updates a master while the weights are in use by the "
                             "next step; it needs master='fp32'")
        self._generator = torch.Generator().manual_seed(seed)  # stochastic rounding, reproducible
        self._seed = seed  # the device update's rounding (train/device.py: Philox keys from it)
        self._scratch = tuple(Scratch() for _ in range(4))  # a chunk's gradients, weights, decoded moments
        self._streamed = [p for g in self.param_groups for p in g["params"] if isinstance(p, HostMasterParameter)]
        self.runtime = _one_runtime(self._streamed)
        self._block_params: dict[int, list[torch.Tensor]] = defaultdict(list)
        for p in self._streamed:
            self._block_params[self._layer(p)[1]].append(p)
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        self._param_of = {self._layer(p)[0]: p for p in self._streamed}
        self._check_shards(delayed_update)
        self._resident = [p for g in self.param_groups for p in g["params"]
                          if not isinstance(p, HostMasterParameter) and p.requires_grad]
        self.resident_lane = ResidentAdamW(master, states, self._resident_on_host(resident_states), self._generator)
        self._preflight()
        for p in progress([p for p in self._streamed if p.requires_grad and self._owned(p)],
                          "HostAdamW: host optimizer states"):
            self.state[p] = new_state(p, master, states, keep_master=delayed_update)
        for p in self._resident:  # made now, so that every step the planner measures holds them
            self.state[p] = self.resident_lane.new_state(p)
        self.worker = None
        self.host_seconds = 0.0  # time spent stepping streamed blocks on the host (benches read it)
        self.blocks_stepped_in_backward = 0  # blocks stepped by the worker while the backward ran
        self.device: DeviceAdamW | None = None  # the device's update lane, once blocks are chosen for it
        self.device_blocks: set[int] = set()
        self._device_updated: set[int] = set()  # layers stepped on the device in this step (train/device.py)
        self.device_choice: dict = {}  # what the choice measured and predicted (benches print it)
        self._device_arenas = []  # the pinned host states of the device blocks
        self._host_steps_timed = 0  # steps whose blocks all stepped on the host, timed ("auto" chooses after two)
        if delayed_update and device_update not in ("auto", "off"):
            raise ValueError("HostAdamW: delayed_update=True steps every block on the host; device_update must be "
                             "'auto' or 'off'")
        self.delayed = DelayedUpdate(self.runtime.grads) if delayed_update and self.runtime is not None else None
        self._device_mode = self._device_update_mode("off" if delayed_update else device_update,
                                                     overlap and max_grad_norm is None)
        if delayed_update:
            self.device_update_note = "delayed_update=True steps every block on the host"
        elif device_update == "auto" and self.device_update_note and self.runtime is not None and \
                self.runtime.device.type == "cuda":
            warnings.warn(f"HostAdamW: device_update='auto' steps every streamed block on the host: "
                          f"{self.device_update_note}", HostUpdateWarning, stacklevel=2)  # once per process
        if self.runtime is not None:
            self.runtime.attach(self)  # step phases, telemetry
            if (overlap and max_grad_norm is None) or self.delayed is not None:  # the delayed update publishes there
                self._start_worker()
        if self.worker is not None and self.delayed is None and accumulation_steps == 1 and \
                self.runtime.grads.shards is None and not _distributed():
            self.resident_lane.overlap(self._resident, lambda p: self.state[p],
                                       lambda p: self._hyper(self._group_of[p]), self.worker.run_later)
        if isinstance(self._device_mode, set) and self._device_mode:
            self._enable_device(self._device_mode)

    def _layer(self, p: torch.Tensor) -> tuple[int, int]:
        """(layer index, block) of a streamed weight."""
        _, index = registry.layer(p._sh_layer)
        return index, self.runtime.layers[index].block

    def _owned(self, p: torch.Tensor) -> bool:
        """Several ranks: this rank keeps the states of, and steps, only the blocks it owns (train/shards.py)."""
        shards = self.runtime.grads.shards if self.runtime is not None else None
        return shards is None or shards.mine(self._layer(p)[1])

    def _check_shards(self, delayed_update: bool) -> None:
        if self.runtime is None or self.runtime.grads.shards is None:
            return
        node = self.runtime.grads.shards.node
        if node is not None:
            share_host_cores(node.local_size)
        if delayed_update:
            raise ValueError("HostAdamW: delayed_update=True is not built for several ranks (each block steps on its "
                             "owner: runtime/train/shards.py); use the default exact update")

    def _resident_on_host(self, requested: str) -> list[torch.Tensor]:
        """The resident parameters whose states live on the host ("auto": see `resident_states`). The model's order
        keeps the embeddings on the device: their gradient is the backward's last, so a host update of theirs could
        hide behind no block, while a head's, final first, overlaps the backward (ResidentAdamW.overlap)."""
        rt = self.runtime
        device = rt.device if rt is not None else next((p.device for p in self._resident), torch.device("cpu"))
        if requested != "auto" or device.type != "cuda":
            return list(self._resident) if requested == "host" else []
        budget = rt.plan_driver.budget.soft or rt.plan_driver.budget.hard if rt is not None else None
        if budget is None:
            room = torch.cuda.mem_get_info(device)[0]
        else:
            room = budget - allocated_bytes(device) - 2 * rt.store.max_block_bytes()
        left, on_host, away = room // 2, [], 0
        for p in self._resident:
            nbytes = state_bytes(local_shard(p), self.master, self.states)
            if nbytes <= left:
                left -= nbytes
            else:
                on_host.append(p)
                away += nbytes
        if on_host:
            warnings.warn(f"HostAdamW: the masters and moments of {len(on_host)} of the {len(self._resident)} "
                          f"resident parameters ({gib(away)}) stay on the host: the VRAM budget leaves "
                          f"{gib(max(0, room))} beside the resident tensors and two slots; each step copies their "
                          "gradients down and their weights up (resident_states='device' keeps them on the GPU)",
                          HostUpdateWarning, stacklevel=2)
        return on_host

    def _preflight(self) -> None:
        moments = f"{self.states} moments (exp_avg, exp_avg_sq)"
        resident = "the resident parameters' masters and moments"
        need = {"fp32 masters": 0, moments: 0, "a second set of gradient buffers (delayed_update)": 0, resident: 0}
        lane, on_device = self.resident_lane, 0
        for p in self._resident:
            if lane.on_host(p) or p.device.type == "cpu":
                need[resident] += lane.state_bytes(p)
            else:
                on_device += lane.state_bytes(p)
        gpu = next((p.device for p in self._resident if p.device.type == "cuda" and not lane.on_host(p)), None)
        if on_device and on_device > torch.cuda.mem_get_info(gpu)[0]:
            raise torch.OutOfMemoryError(
                f"HostAdamW: the masters and moments of the {len(self._resident)} resident parameters need "
                f"{gib(on_device)} on {gpu}, more than is free there; pass resident_states='host', master='bf16' "
                "or states='int8'")
        for p in self._streamed:
            if p.requires_grad and self._owned(p):
                total = state_bytes(p, self.master, self.states)
                need[moments] += int(STATE_BYTES[self.states] * p.numel())
                need["fp32 masters"] += total - int(STATE_BYTES[self.states] * p.numel())
                if self._delayed_update:  # a master for every weight, and the gradients the update reads
                    need["fp32 masters"] += 4 * p.numel() if p.dtype == torch.float32 else 0
                    need["a second set of gradient buffers (delayed_update)"] += p.numel() * p.element_size()
        machine = probe_machine()
        if sum(need.values()) <= machine.usable_bytes:
            return
        parts = ", ".join(f"{k} {gib(v)}" for k, v in need.items() if v)
        count = len(self._streamed) + len(self._resident)
        fix = "master='bf16' (the bf16 weights are their own master: 4 bytes a parameter fewer); " \
            if self.master == "fp32" and need["fp32 masters"] else ""
        fix += f"states='int8' (2 bytes a parameter for the moments instead of {STATE_BYTES[self.states]:.0f}); " \
            if self.states != "int8" else ""
        raise HostMemoryError(
            f"HostAdamW: the optimizer states of {count} parameters need {gib(sum(need.values()))} "
            f"of host memory ({parts}) and {gib(machine.usable_bytes)} can be had ({machine.describe()}). To fit: "
            f"{fix}freeze some streamed weights, or train LoRA adapters instead")

    def _trained(self, block: int) -> list[torch.Tensor]:
        return [p for p in self._block_params[block] if p in self.state]

    def _start_worker(self) -> None:
        lane = self.runtime.grads
        if lane.consumer is not None:
            raise ValueError("HostAdamW: another HostAdamW already steps this model's streamed weights as they land; "
                             "one optimizer per offloaded model (or overlap=False)")
        blocks = {b: {self._layer(p)[0] for p in ps if p.requires_grad and self._owned(p)}
                  for b, ps in self._block_params.items()}
        step_block = self._publish_block if self.delayed is not None else self._step_block
        self.worker = LandingWorker(lane, {b: s for b, s in blocks.items() if s}, step_block,
                                    self.accumulation_steps, device=self)
        lane.consumer = self.worker
        self.runtime.on_close(self.close)

    def close(self) -> None:
        """Stop the landing worker and the delayed update's thread (the runtime closes it with itself)."""
        if self.delayed is not None:
            self.delayed.join()  # a thread still in the fused kernel at interpreter exit aborts the process
        if self.worker is not None:
            self.worker.close()
            if self.runtime.grads.consumer is self.worker:
                self.runtime.grads.consumer = None
                self.runtime.grads.device_updates = {}
            self.worker = None
        self.device = None
        self.resident_lane.close()
        self._unpin_device_states()  # restore() frees every pinned byte, the optimizer's too

    def _hyper(self, group: dict) -> Hyper:
        beta1, beta2 = group["betas"]
        return Hyper(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])

    def _step_block(self, block: int, scale: float = 1.0) -> None:
        """Step the block's streamed weights that have a gradient; refresh the block's streamed copy."""
        # Stepped on the device in this step's last backward, the write-back waited for: the weights are new.
        # (A weight of a device block with a gradient but no device update, e.g. a step after fewer backwards
        # than accumulation_steps, steps on the host below.)
        on_device = [p for p in self._trained(block) if self._layer(p)[0] in self._device_updated]
        for p in on_device:
            torch.autograd.graph.increment_version(p)
            p.grad = None  # an accumulation cycle's host sum went up with the states: consumed
        by_group: dict[int, list[torch.Tensor]] = defaultdict(list)
        for p in self._block_params[block]:
            if p.grad is not None and p in self.state:
                by_group[id(self._group_of[p])].append(p)
        if not by_group:
            if on_device:
                self.runtime.store.ensure_fresh(block, self.runtime.precision[block])  # derived copies, now
            return
        t0 = time.perf_counter()
        for ps in by_group.values():
            grads = [p.grad if scale == 1.0 else p.grad * scale for p in ps]
            adamw_step(ps, grads, [self.state[p] for p in ps], self._hyper(self._group_of[ps[0]]), self.master,
                       self._scratch, self._generator)
            for p in ps:
                p.grad = None  # consumed: the next backward lands a new one
        rt = self.runtime
        rt.store.ensure_fresh(block, rt.precision[block])  # an INT8 / FP8 stream is rebuilt now, off the hot path
        seconds = time.perf_counter() - t0
        self.host_seconds += seconds
        if self.worker is not None:  # overlapped with the backward: the planner models it as a lane of its own
            rt.grads.optimizer_seconds[block] = seconds

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.delayed is not None:
            self.worker.drain()  # this backward's publishing of the last update, block by block
            self.delayed.join()
            scale = self._clip_scale() if self.max_grad_norm is not None else 1.0
            self._step_delayed(scale)
            self._step_resident(scale)
            self.worker.next_step()
            return loss
        stepped: set[int] = set()
        if self.worker is not None:
            self.worker.drain()
            if self.worker.backwards > self.accumulation_steps:
                raise RuntimeError(
                    f"HostAdamW: {self.worker.backwards} backward passes ran since the last step, but "
                    f"accumulation_steps={self.accumulation_steps}: the blocks already stepped during backward "
                    f"{self.accumulation_steps}; call step() every {self.accumulation_steps} backward(s), or pass "
                    "overlap=False")
            stepped = set(self.worker.stepped)
            self.blocks_stepped_in_backward += len(stepped)
            if self._device_mode == "auto" and stepped:
                self._host_steps_timed += 1
                if self._host_steps_timed == CHOOSE_AFTER_STEPS:
                    self._device_mode = "chosen"
                    self._choose_device_blocks()
        scale = self._clip_scale() if self.max_grad_norm is not None else 1.0
        for block in self._block_params:
            if block not in stepped:
                self._step_block(block, scale)
        self._step_resident(scale)
        self._device_updated.clear()
        if self.worker is not None:
            self.worker.next_step()
        return loss

    def _step_resident(self, scale: float) -> None:
        """Step the parameters that do not stream (ResidentAdamW); copy up those stepped in the backward."""
        for group in self.param_groups:
            ps = [p for p in group["params"] if not isinstance(p, HostMasterParameter) and p.grad is not None]
            if not ps:
                continue
            for p in ps:
                if p not in self.state:  # made trainable after the optimizer was built
                    self.state[p] = self.resident_lane.new_state(p)
            if scale != 1.0:
                torch._foreach_mul_([p.grad for p in ps], scale)
            self.resident_lane.step(ps, [self.state[p] for p in ps], self._hyper(group))
        self.resident_lane.publish_ahead()

    def _clip_scale(self) -> float:
        """min(1, max_grad_norm / the global L2 norm of every gradient), one host read per device. Several ranks: the
        streamed gradients' squares (each on its block's owner) are summed over the ranks; the resident ones once."""
        streamed = _squared_norm([p.grad for p in self._streamed if p.grad is not None])
        resident = _squared_norm([p.grad for g in self.param_groups for p in g["params"]
                                  if p.grad is not None and not isinstance(p, HostMasterParameter)])
        shards = self.runtime.grads.shards if self.runtime is not None else None
        if shards is not None:
            streamed = shards.sum_over_blocks(streamed)
        total = (streamed + resident) ** 0.5
        return min(1.0, self.max_grad_norm / (total + 1e-6))

    def state_dict(self) -> dict:
        """torch's, with the stochastic rounding's random stream; a pending delayed update is published first."""
        self.flush()
        return dict(super().state_dict(), stagehand_rng=self._generator.get_state())

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that every parameter's states stay as kept (torch casts them to the parameter's dtype:
        fp32 masters and moments of a bf16 weight, int8 codes), a resident parameter's where `resident_states`
        places them, and the random stream continues where it was saved."""
        params = [p for g in self.param_groups for p in g["params"]]
        model = self.runtime.model if self.runtime is not None else None
        names = {p: n for n, p in model.named_parameters()} if model is not None else {}
        exact = {params[i]: {k: v.clone() for k, v in st.items()} for i, st in state_dict["state"].items()}
        for p, st in exact.items():
            kept = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}.get(st["exp_avg"].dtype)
            if kept != self.states:
                old = " (a checkpoint of a HostAdamW that stepped the resident parameters in their own dtype)" \
                    if not isinstance(p, HostMasterParameter) and kept == "bf16" else ""
                raise ValueError(f"HostAdamW.load_state_dict: the saved moments of {names.get(p, 'a parameter')} "
                                 f"are {kept}{old}, this optimizer keeps states={self.states!r}")
        rng = state_dict.get("stagehand_rng")
        state_dict = {k: v for k, v in state_dict.items() if k != "stagehand_rng"} | \
            {"state": {i: st for i, st in state_dict["state"].items() if params[i] not in exact}}
        super().load_state_dict(state_dict)
        for p, st in exact.items():
            self.state[p] = st if isinstance(p, HostMasterParameter) else self.resident_lane.adopt(p, st)
        self._repin_device_states()
        if rng is not None:
            self._generator.set_state(rng)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _squared_norm(grads: list[torch.Tensor]) -> float:
    """The sum of the gradients' squares in fp32, read once per device (not once per tensor: a sync each; torch's
    get_total_norm would take a bf16 gradient's norm in bf16)."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_device[g.device].append(g)
    total = 0.0
    for gs in by_device.values():
        norms = torch._foreach_norm(gs, 2, dtype=torch.float32)
        total += float(torch.stack(norms).square().sum())
    return total


def share_host_cores(ranks: int) -> None:
    """torchrun sets OMP_NUM_THREADS=1 in every rank it starts (when unset), which would leave the host optimizer
    one core: left at one thread, each rank takes its share of the cores the process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // ranks)
    if torch.get_num_threads() == 1 and share > 1:
        torch.set_num_threads(share)
        log.warning("stagehand HostAdamW: torch ran on 1 thread (torchrun's OMP_NUM_THREADS=1); the host optimizer "
                    "uses %d threads per rank (%d cores, %d ranks of this node); set OMP_NUM_THREADS to choose", share,
                    cores, ranks)


def _one_runtime(streamed: list[HostMasterParameter]):
    """The runtime whose streamed weights these are (one offloaded model per optimizer)."""
    runtimes = {id(registry.layer(p._sh_layer)[0]): registry.layer(p._sh_layer)[0] for p in streamed}
    if len(runtimes) > 1:
        raise ValueError("HostAdamW: the parameters stream from two offloaded models; one optimizer per model")
    return next(iter(runtimes.values()), None)


__all__ = ["HostAdamW"]
