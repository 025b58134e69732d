"""AdamW on the host for streamed weights: a block steps as soon as its gradients have landed.

`LandingWorker` takes each gradient as it lands (train/grads.py) and steps a block once all its trainable weights
have theirs, while the GPU runs the backward of the blocks before it (fused CPU AdamW releases the GIL). Per weight:
an fp32 master (`master="bf16"`: none, updates written back with unbiased stochastic rounding) and moments in fp32,
bf16 (stochastically rounded: an average moving by less than a bf16 step would freeze) or int8 (a scale per QBLOCK:
`exp_avg` as codes of its absmax, `exp_avg_sq` of its square root, never decoding a nonzero one to zero, a step of
lr / eps). `ResidentAdamW` steps the parameters that do not stream with the same master and moments."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable

import torch
from torch.optim.adam import adam as adam_functional

from torch_stagehand.environment import tunable
from torch_stagehand.runtime.streamed import is_dtensor

MASTERS = ("fp32", "bf16")
STATES = ("fp32", "bf16", "int8")
QBLOCK = 128  # elements per scale of int8 moments
STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 2 * 4 / QBLOCK}  # exp_avg + exp_avg_sq, a parameter


class Noise:
    """Uniform noise for stochastic rounding, drawn once per `adamw_step` call: a buffer of a chunk and a window
    more, each chunk reading a slice at a random offset (a value per element from torch's one-thread CPU generator
    costs more than the step). Two elements of one step may share a value: each one's rounding stays unbiased."""

    WINDOW = 1 << 16

    def __init__(self, generator: torch.Generator | None, device: torch.device | None = None):
        # One random stream wherever the weights live: on a GPU the generator draws only a device generator's seed.
        self.generator = generator
        self.device = device if device is not None and device.type != "cpu" else None
        self._draw = generator
        if self.device is not None:
            seed = int(torch.randint(0, 1 << 62, (1,), generator=generator))
            self._draw = torch.Generator(self.device).manual_seed(seed)
        self._buffers: dict[str, torch.Tensor] = {}  # "bits" / "unit": a chunk and a window of values

    def _values(self, kind: str, n: int) -> torch.Tensor:
        if kind == "bits":  # int32 in [0, 2**16): bf16 rounding
            return torch.randint(0, 1 << 16, (n,), dtype=torch.int32, generator=self._draw, device=self.device)
        return torch.rand(n, generator=self._draw, device=self.device)  # float32 in [0, 1): int8 codes

    def draw(self, kind: str, n: int) -> torch.Tensor:
        if n > tunable("host_adamw_chunk"):  # more than a chunk at once: a value per element
            return self._values(kind, n)
        if kind not in self._buffers:
            self._buffers[kind] = self._values(kind, tunable("host_adamw_chunk") + self.WINDOW)
        buf = self._buffers[kind]
        offset = int(torch.randint(0, buf.numel() - n + 1, (1,), generator=self.generator))
        return buf[offset:offset + n]


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None,
                      noise: Noise | None = None) -> None:
    """Write fp32 `src` into bf16 `dst`, rounding up with probability equal to the distance (unbiased): bf16 is
    fp32's upper 16 bits, so a uniform random 16-bit integer added to the bits before truncating does it.
    `noise`: the step's shared `Noise`; without it, a value is drawn per element."""
    bits = src.contiguous().view(torch.int32)
    noise = noise.draw("bits", src.numel()).view(src.shape) if noise is not None else \
        torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, generator=generator)
    rounded = (bits + noise) & -65536  # keep the upper 16 bits (0xFFFF0000 as a signed int32)
    dst.copy_(rounded.view(torch.float32))  # exact: the value is a bf16 value


@dataclass
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def fused_step(self, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                   step: torch.Tensor) -> None:
        """torch's fused AdamW of `w` from `g` (fp32 moments `m`, `v`; `step`: a 0-dim count, counted up first)."""
        adam_functional([w], [g], [m], [v], [], [step], fused=True, decoupled_weight_decay=True, amsgrad=False,
                        beta1=self.beta1, beta2=self.beta2, lr=self.lr, weight_decay=self.weight_decay, eps=self.eps,
                        maximize=False)


class Scratch:
    """fp32 working buffers for one block's step, carved from one allocation kept across steps (a fresh one would
    fault its pages in every time), on `device` (the host by default)."""

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self._buf = torch.empty(0, dtype=torch.float32, device=device)

    def buffer(self, n: int) -> torch.Tensor:
        """`n` fp32 elements, flat."""
        if self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=torch.float32, device=self.device)
        return self._buf[:n]


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], hyper: Hyper,
               master: str, scratch: tuple[Scratch, ...], generator: torch.Generator | None = None,
               write_weights: bool = True) -> None:
    """One AdamW step of host weights from their gradients, in fp32, written back in the weights' dtype. `scratch`:
    a chunk's working buffers (gradients, weights stepped in fp32; two more for decoded moments).
    `write_weights=False`: only the masters and moments move (the delayed update publishes the weights later)."""
    if not params:
        return
    device = params[0].device
    grad32, weight32 = (sc.buffer(tunable("host_adamw_chunk")) for sc in scratch[:2])
    step = torch.zeros((), dtype=torch.float32, device=device)  # the fused kernel wants it beside the weights
    noise = Noise(generator, device)
    for p, g, st in zip(params, grads, states):
        w, g = p.detach().view(-1), g.view(-1)
        fp32_master = st["master"].view(-1) if "master" in st else None
        rounded = fp32_master is None and w.dtype != torch.float32  # master="bf16": stochastic rounding
        moments = Moments(st, scratch[2:], noise)
        for a in range(0, w.numel(), moments.chunk):
            b = min(w.numel(), a + moments.chunk)
            g32 = g[a:b] if g.dtype == torch.float32 else grad32[: b - a].copy_(g[a:b])
            target = fp32_master[a:b] if fp32_master is not None else \
                weight32[: b - a].copy_(w[a:b]) if rounded else w[a:b]
            m, v = moments.decode(a, b)
            step.copy_(st["step"])  # the kernel counts the step on each call: every chunk starts from the same
            hyper.fused_step(target, g32, m, v, step)
            with torch.no_grad():
                moments.encode(a, b)
                if rounded:
                    stochastic_round_(w[a:b], target, noise=noise)
                elif fp32_master is not None and write_weights:
                    w[a:b].copy_(target)  # round to nearest; the master keeps the exact value
        st["step"].add_(1)
        # The fused kernel writes without moving the version counter: mark the weight written, so slots and the
        # INT8 / FP8 copies are refreshed before they are served.
        if write_weights:
            torch.autograd.graph.increment_version(p)


class Moments:
    """One weight's `exp_avg` / `exp_avg_sq` as the fused kernel wants them: fp32 views of the chunk being
    stepped (the states themselves when they are fp32; decoded into scratch, and encoded back, otherwise)."""

    def __init__(self, state: dict, scratch: tuple[Scratch, ...], noise: Noise):
        self.st, self.noise = state, noise
        self.kind = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}[state["exp_avg"].dtype]
        # int8 chunks hold whole scale blocks (the chunk is a multiple of QBLOCK; a test's small one is rounded up)
        chunk = tunable("host_adamw_chunk")
        self.chunk = chunk if self.kind != "int8" else max(QBLOCK, chunk // QBLOCK * QBLOCK)
        if self.kind != "fp32":
            self.m32, self.v32 = (sc.buffer(self.chunk) for sc in scratch)

    def decode(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        m, v = self.st["exp_avg"].view(-1), self.st["exp_avg_sq"].view(-1)
        if self.kind == "fp32":
            return m[a:b], v[a:b]
        n = b - a
        if self.kind == "bf16":
            return self.m32[:n].copy_(m[a:b]), self.v32[:n].copy_(v[a:b])
        blocks = slice(a // QBLOCK, -(-b // QBLOCK))
        m32, v32 = self._padded(self.m32, m[a:b]), self._padded(self.v32, v[a:b])
        m32.view(-1, QBLOCK).mul_(self.st["exp_avg_scale"][blocks, None])
        v32.view(-1, QBLOCK).mul_(self.st["exp_avg_sq_scale"][blocks, None]).square_()  # codes of sqrt(v)
        return m32[:n], v32[:n]

    @staticmethod
    def _padded(buf: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """`codes` as fp32 in `buf`, zero-padded to whole scale blocks."""
        n = codes.numel()
        out = buf[:-(-n // QBLOCK) * QBLOCK]
        out[:n].copy_(codes)
        out[n:].zero_()
        return out

    def encode(self, a: int, b: int) -> None:
        if self.kind == "fp32":
            return
        m, v, n = self.st["exp_avg"].view(-1), self.st["exp_avg_sq"].view(-1), b - a
        if self.kind == "bf16":
            stochastic_round_(m[a:b], self.m32[:n], noise=self.noise)
            stochastic_round_(v[a:b], self.v32[:n], noise=self.noise)
            return
        blocks = slice(a // QBLOCK, -(-b // QBLOCK))
        padded = -(-n // QBLOCK) * QBLOCK
        m32, v32 = self.m32[:padded].view(-1, QBLOCK), self.v32[:padded].view(-1, QBLOCK)
        m[a:b].copy_(self._codes(m32, 127, self.st["exp_avg_scale"][blocks]).view(-1)[:n])
        nonzero = v32 > 0
        codes = self._codes(v32.sqrt_(), 255, self.st["exp_avg_sq_scale"][blocks])
        v[a:b].copy_(torch.maximum(codes, nonzero.float()).view(-1)[:n])  # a nonzero moment never decodes to 0

    def _codes(self, x: torch.Tensor, top: int, scale: torch.Tensor) -> torch.Tensor:
        """Stochastically rounded codes of `x` (blocks of QBLOCK) in [-top, top], its blocks' scales written to
        `scale` (absmax / top): floor(x / scale + U[0, 1)) is x / scale rounded up with probability equal to
        its fraction, so the decoded value is unbiased."""
        torch.div(x.abs().amax(dim=1), top, out=scale)
        x.div_(scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
        x.add_(self.noise.draw("unit", x.numel()).view(x.shape)).floor_()
        return x.clamp_(-top, top)


def new_state(p: torch.Tensor, master: str, states: str = "fp32", keep_master: bool = False,
              pin: bool = False) -> dict:
    """The moments in `states`, and an fp32 master of a low-precision weight under master="fp32" (of any weight
    with `keep_master`: the delayed update), on the weight's device (page-locked with `pin`)."""
    kw = dict(device=p.device, pin_memory=pin)
    if states == "int8":
        n, blocks = p.numel(), -(-p.numel() // QBLOCK)
        state = {"exp_avg": torch.zeros(n, dtype=torch.int8, **kw), "exp_avg_scale": torch.zeros(blocks, **kw),
                 "exp_avg_sq": torch.zeros(n, dtype=torch.uint8, **kw), "exp_avg_sq_scale": torch.zeros(blocks, **kw)}
    else:
        dtype = torch.float32 if states == "fp32" else torch.bfloat16
        state = {key: torch.zeros(p.shape, dtype=dtype, **kw) for key in ("exp_avg", "exp_avg_sq")}
    state = {"step": torch.zeros((), dtype=torch.float32, device=p.device), **state}
    if (master == "fp32" and p.dtype != torch.float32) or keep_master:  # memory of its own, also for an fp32 weight
        state["master"] = torch.empty(p.shape, dtype=torch.float32, **kw).copy_(p.detach())
    return state


def state_bytes(p: torch.Tensor, master: str, states: str = "fp32") -> int:
    return int(p.numel() * (STATE_BYTES[states] + (4 if master == "fp32" and p.dtype != torch.float32 else 0)))


RESIDENT_PLACES = ("auto", "device", "host")


class ResidentAdamW:
    """AdamW for the parameters that do not stream (embeddings, heads, norms, biases, LoRA adapters), with the
    streamed weights' master and moments (in a bf16 parameter's own dtype an update below half a spacing rounds
    away). `host`: the parameters whose states live in page-locked host memory (gradient down, step on the host,
    weight up, as ZeRO-Offload does); the others keep them beside the parameter. A DTensor steps its local shard."""

    def __init__(self, master: str, states: str, host, generator: torch.Generator):
        self.master, self.states, self.generator = master, states, generator
        self.host: set[torch.Tensor] = set(host)
        self._scratch: dict[torch.device, tuple[Scratch, ...]] = {}
        # Host-placed GPU parameters: page-locked copies of the stepped value and of the gradient (made again from the
        # parameter, not optimizer state); the version copied down last (a parameter written since is copied again)
        self._staging: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._copied_version: dict[torch.Tensor, int] = {}
        self._hooks: list = []  # `overlap`: the gradient hooks
        self._ahead: set[torch.Tensor] = set()  # host-placed parameters stepped during this backward
        self._landing_scratch = tuple(Scratch() for _ in range(4))  # the landing thread's own

    def overlap(self, params: list[torch.Tensor], state_of: Callable, hyper_of: Callable,
                run_later: Callable) -> None:
        """Step each host-placed parameter during the backward, as soon as its gradient is final: its
        post-accumulate-grad hook copies the gradient down on a side stream and `run_later(work)` steps it on the
        landing thread, in order with the streamed blocks' landings; `step()` only copies the weights up. For one
        backward per step on one rank (DDP reduces a gradient after this hook would read it)."""
        away = [p for p in params if self.on_host(p)]
        if not away:
            return
        self._copies = torch.cuda.Stream(away[0].device)
        self._state_of, self._hyper_of, self._run_later = state_of, hyper_of, run_later
        self._hooks = [p.register_post_accumulate_grad_hook(self._landed) for p in away]

    def _landed(self, p: torch.Tensor) -> None:
        if p.grad is None or p in self._ahead:
            return
        value, host_grad = self._staging[p]
        self._copies.wait_stream(torch.cuda.current_stream(p.device))
        with torch.cuda.stream(self._copies):
            self._refresh(p)
            host_grad.copy_(local_shard(p.grad), non_blocking=True)
            p.grad.record_stream(self._copies)
            copied = self._copies.record_event()
        self._ahead.add(p)
        state, hyper = self._state_of(p), self._hyper_of(p)

        def work():  # on the landing thread: the thread issuing the backward never waits here
            copied.synchronize()
            adamw_step([value], [host_grad], [state], hyper, self.master, self._landing_scratch, self.generator)

        self._run_later(work)

    def _refresh(self, p: torch.Tensor) -> None:
        """Copy the parameter down into its staged value if it was written since the last copy."""
        local = local_shard(p)
        if self._copied_version.get(p) != local._version:
            self._staging[p][0].copy_(local, non_blocking=True)
            self._copied_version[p] = local._version

    def _copy_up(self, p: torch.Tensor) -> None:
        local = local_shard(p)
        local.copy_(self._staging[p][0], non_blocking=True)  # on the compute stream, before the next forward
        self._copied_version[p] = local._version

    def close(self) -> None:
        """Remove the gradient hooks and free the page-locked staging (the states stay with the optimizer)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._staging.clear()
        self._copied_version.clear()

    def on_host(self, p: torch.Tensor) -> bool:
        return p in self.host and p.device.type != "cpu"

    def place(self, params: list[torch.Tensor]) -> str:
        """Where `params`' states live, in words."""
        away = sum(self.on_host(p) for p in params)
        if away in (0, len(params)):
            return "host" if away else "device"
        return f"host for {away} of {len(params)} parameters, the rest on the device"

    def new_state(self, p: torch.Tensor) -> dict:
        if not self.on_host(p):
            return new_state(local_shard(p), self.master, self.states)
        return new_state(self._stage(p), self.master, self.states, pin=True)

    def _stage(self, p: torch.Tensor) -> torch.Tensor:
        if p not in self._staging:
            local = local_shard(p)  # a DTensor's shard: the value and the gradient are this rank's part
            value = torch.empty(local.shape, dtype=p.dtype, pin_memory=True).copy_(local)
            self._staging[p] = (value, torch.empty(local.shape, dtype=p.dtype, pin_memory=True))
            self._copied_version[p] = local._version
        return self._staging[p][0]

    def adopt(self, p: torch.Tensor, state: dict) -> dict:
        """A loaded state, values as saved, placed where this lane keeps it (torch's would cast it)."""
        if self.on_host(p):
            self._stage(p)
            state = {k: v.to("cpu").pin_memory() if k != "step" else v.to("cpu", torch.float32)
                     for k, v in state.items()}
        else:
            state = {k: v.to(p.device) if k != "step" else v.to(p.device, torch.float32) for k, v in state.items()}
        if "master" not in state and self.master == "fp32" and p.dtype != torch.float32:
            state["master"] = local_shard(p).float().to(state["exp_avg"].device)  # saved by an optimizer without one
        return state

    def state_bytes(self, p: torch.Tensor) -> int:
        local = local_shard(p)  # a DTensor's shard
        staging = 2 * local.numel() * local.element_size() if self.on_host(p) else 0
        return state_bytes(local, self.master, self.states) + staging

    def _scratch_for(self, device: torch.device) -> tuple[Scratch, ...]:
        if device not in self._scratch:
            self._scratch[device] = tuple(Scratch(device) for _ in range(4))
        return self._scratch[device]

    def publish_ahead(self) -> None:
        """Copy up the weights stepped during the backward (`overlap`; the landing thread is drained)."""
        for p in self._ahead:
            self._copy_up(p)
        self._ahead.clear()

    def step(self, params: list[torch.Tensor], states: list[dict], hyper: Hyper) -> None:
        """One AdamW step of `params` from their (clipped) `.grad`, less those stepped during the backward."""
        keep = [i for i, p in enumerate(params) if p not in self._ahead]
        params, states = [params[i] for i in keep], [states[i] for i in keep]
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(params):
            if not self.on_host(p):
                by_device.setdefault(p.device, []).append(i)
        for device, idx in by_device.items():
            adamw_step([local_shard(params[i]) for i in idx], [local_shard(params[i].grad) for i in idx],
                       [states[i] for i in idx], hyper, self.master, self._scratch_for(device), self.generator)
        away = [i for i, p in enumerate(params) if self.on_host(p)]
        if not away:
            return
        values, grads = zip(*(self._staging[params[i]] for i in away))
        for i, g in zip(away, grads):
            self._refresh(params[i])
            g.copy_(local_shard(params[i].grad), non_blocking=True)
        # only off the overlapped path: the host needs the final gradients
        torch.cuda.current_stream(params[away[0]].device).record_event().synchronize()
        adamw_step(list(values), list(grads), [states[i] for i in away], hyper, self.master,
                   self._scratch_for(torch.device("cpu")), self.generator)
        for i in away:
            self._copy_up(params[i])  # the next step's copies down wait for it too (the same stream)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `t`'s values on this rank: the local shard of a DTensor (FSDP2), `t` itself otherwise."""
    t = t.detach()
    return t._local_tensor if is_dtensor(t) else t


class LandingWorker:
    """A thread that applies each landed gradient (`GradLane.apply`) and steps a block (`step_block`) once every
    layer of it in `blocks` (block -> layer indices) has landed, in the backward that ends an accumulation cycle.
    `device`: the optimizer; a block it steps on the GPU (train/device.py) lands here only to await its write-back."""

    def __init__(self, lane, blocks: dict[int, set[int]], step_block: Callable[[int], None],
                 accumulation_steps: int, device=None):
        self.lane, self.blocks, self.step_block, self.device = lane, blocks, step_block, device
        self.accumulation_steps = accumulation_steps
        self.backwards = 0  # backwards since the last optimizer step
        self._landed: dict[int, set[int]] = {b: set() for b in blocks}
        self.stepped: set[int] = set()  # blocks stepped in this step
        self._queue: queue.Queue = queue.Queue()  # join() waits for every landing put so far
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="stagehand-host-adamw", daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        """Is this backward the one whose gradients complete a step (the last of an accumulation cycle)?"""
        return self.backwards == self.accumulation_steps

    def begin_backward(self) -> None:
        self.backwards += 1

    def landed(self, land) -> None:
        self._queue.put(land)

    def updates_on_device(self, block: int) -> bool:
        return self.device is not None and self.device.updates_on_device(block)

    def update_on_device(self, index: int, grad: torch.Tensor, compute, partial=None) -> tuple:
        return self.device.update_on_device(index, grad, compute, partial)

    def run_later(self, work: Callable[[], None]) -> None:
        """Run `work` on this thread, in order with the landings (`drain()` waits for it too)."""
        self._queue.put(work)

    def _run(self) -> None:
        while True:
            land = self._queue.get()
            try:
                if land is None:
                    return
                if self._error is None:
                    land() if callable(land) else self._take(land)
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread at the optimizer step
                self._error = e
            finally:
                self._queue.task_done()

    def _take(self, land) -> None:
        block = self.lane.block_of(land.index)
        if not land.updated and self.device is not None and self.device.updated_on_device(land.index):
            raise RuntimeError(
                f"stagehand HostAdamW: {self.lane.layers[land.index].fqn}.weight got another gradient after it was "
                "stepped on the device in this backward (a layer run twice, or shared weights): use "
                "device_update='off'")
        if block in self.stepped:
            raise RuntimeError(
                f"stagehand HostAdamW: {self.lane.layers[land.index].fqn}.weight got another gradient after its "
                "block was stepped in this step (a layer run twice, or shared weights): use overlap=False")
        self.lane.apply(land)
        landed = self._landed.get(block)
        if landed is None:
            return  # a weight this optimizer does not step
        landed.add(land.index)
        if landed >= self.blocks[block]:
            self.step_block(block)
            self.stepped.add(block)

    def drain(self) -> None:
        """Wait until every landing so far is applied (and its block stepped); re-raise a worker's error."""
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def next_step(self) -> None:
        """The optimizer stepped: a new accumulation cycle begins."""
        self.backwards = 0
        self.stepped.clear()
        for landed in self._landed.values():
            landed.clear()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)


__all__ = ["LandingWorker", "ResidentAdamW", "local_shard", "RESIDENT_PLACES", "Hyper", "Moments", "Noise", "Scratch",
           "adamw_step", "new_state", "state_bytes", "stochastic_round_", "MASTERS", "STATES", "STATE_BYTES"]
