"""Gradients of trainable streamed weights: computed on the device in backward, landed in host buffers.

The host copy is the master the optimizer steps, so the gradient goes home: each trainable layer's grad-weight GEMM
(`stagehand::grad_weight`) fills a ring of device staging buffers the D2H stream copies at once into the block's
pinned host gradient buffer (the master's layout); nothing waits. At the backward's end (`finish`) each weight's
`.grad` becomes a view of its buffer (accumulated as PyTorch does). A block's grad *anchor*, a 0-dim device tensor
its streamed Linears take as an input, requires grad exactly when one of its streamed weights does: autograd's
reason to run the backward of a block whose inputs need no grad."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.blocks import StreamedLayerSpec
from torch_stagehand.runtime.host.node_store import several_ranks

STAGING_RING = 3  # device staging buffers: a GEMM may fill one while two copies are in flight


@dataclass
class _Landing:
    """One gradient on its way to the host: where it lands, and whether it adds to the weight's `.grad`."""
    index: int
    target: torch.Tensor
    event: "torch.cuda.Event | None"
    direct: bool  # written straight into the weight's host gradient buffer (the weight had no .grad)
    updated: bool = False  # no gradient came home: the optimizer stepped the weight on the device (train/device.py)


class GradLane:
    def __init__(self, layers: list[StreamedLayerSpec], store, device: torch.device, first_layer: dict[int, int]):
        """`first_layer`: block -> the index in `layers` of its first streamed layer (the runtime's)."""
        self.layers, self.store, self.device = layers, store, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.n_blocks = len(store.blocks)
        self.first_layer = first_layer
        self.anchors = [torch.zeros((), device=self.device) for _ in range(self.n_blocks)]
        self.host: dict[int, torch.Tensor] = {}  # block -> flat host gradient buffer (the master's layout)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging: list[torch.Tensor] = []
        self._staging_free: list["torch.cuda.Event | None"] = [None] * STAGING_RING
        self._next_staging = 0
        self._landing: list[_Landing] = []
        self._queued_for: int | None = None  # the backward (graph task) whose end runs finish()
        # A host optimizer stepping blocks as their gradients land (train/host.py): `begin_backward()` at the first
        # gradient of every backward, then each landing while it is `accepting`.
        self.consumer = None
        self._consumed: set[int] = set()  # layers handed to the consumer in this backward
        # A backward is everything between two forwards (a recomputed block's nested backward is part of the outer one).
        self._in_backward = False
        self.optimizer_seconds: dict[int, float] = {}  # block -> its last host optimizer step, measured
        self.device_updates: dict[int, tuple[int, int]] = {}  # block updated on the device -> (H2D, D2H) bytes a step
        self.d2h_bytes = self.grad_gemms = 0
        self.shards = None  # several ranks (train/shards.py): a block's gradients summed into its owner
        self.step_syncs = False  # an attached optimizer's step syncs the ranks (Runtime.attach): no fetch needs to
        self._gathering: dict[int, tuple[int, set[int]]] = {}  # block -> (its buffer, the layers it holds)
        self._block_buffers: list[torch.Tensor] = []
        self._block_free: list["torch.cuda.Event | None"] = []

    def trainable(self, index: int) -> bool:
        return self.layers[index].weight.requires_grad

    def trainable_positions(self, block: int) -> tuple[int, ...]:
        first = self.first_layer[block]
        return tuple(i - first for i in range(first, first + len(self.store.blocks[block].layers)) if self.trainable(i))

    def lands(self, block: int) -> bool:
        """Whether this rank lands the block's gradients (several ranks: only its owner does, train/shards.py)."""
        return self.shards is None or self.shards.mine(block)

    def sync_anchor(self, block: int) -> None:
        """The block's anchor requires grad exactly while one of its streamed weights does."""
        wants = bool(self.trainable_positions(block))
        if wants and self.shards is None and several_ranks():
            raise RuntimeError(
                f"stagehand: a streamed weight of block {block} was made trainable after offload on one of several "
                "ranks, which offload did not prepare for (each block's gradient goes to one owner, train/shards.py): "
                "set requires_grad before offload, or Config(node_shared_store='auto') so offload prepares it")
        if self.anchors[block].requires_grad != wants:
            self.anchors[block].requires_grad_(wants)
        if wants and block not in self.host and self.lands(block):
            self.host.update(self.store.grad_buffers([block]))

    def sync_all(self) -> None:
        """Every anchor from the weights' flags; the gradient buffers of every training block in one allocation."""
        training = [b for b in range(self.n_blocks) if self.trainable_positions(b) and b not in self.host
                    and self.lands(b)]
        if training:
            self.host.update(self.store.grad_buffers(training))
        for block in range(self.n_blocks):
            self.sync_anchor(block)

    def grad_bytes(self) -> list[int]:
        """Per block: the bytes of its training weights' gradients, landed on the host each step (the planner)."""
        out = [0] * self.n_blocks
        for spec in self.layers:
            weight = spec.module._parameters[spec.param]
            if weight.requires_grad:
                out[spec.block] += weight.numel() * weight.element_size()
        return out

    def grad_weight_at(self, block: int, position: int, dy: torch.Tensor, x: torch.Tensor) -> None:
        """`grad_weight` of the block's `position`-th streamed layer (how a compiled block names it)."""
        self.grad_weight(self.first_layer[block] + position, dy, x)

    def grad_weight(self, index: int, dy: torch.Tensor, x: torch.Tensor) -> None:
        """Compute layer `index`'s weight gradient from its output gradient and its input, and send it home."""
        spec = self.layers[index]
        weight = spec.module._parameters[spec.param]
        if not weight.requires_grad:
            return  # frozen after the graph was compiled: nothing to deliver
        if not self._in_backward:
            self._in_backward = True
            self._consumed.clear()
            if self.consumer is not None:
                self.consumer.begin_backward()
        self._queue_finish()
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        # dW = dy^T x for a Linear ([out, in]); a transposed layer (Conv1D) stores [in, out]: x^T dy
        a, b = (x2, dy2) if spec.transposed else (dy2, x2)
        if self.shards is not None:
            return self._gather(index, a, b)
        home = self._layer_view(self.host[spec.block], spec.block, index)  # the weight's stored orientation
        direct = self._direct(index)
        consumer = self.consumer if self.consumer is not None and self.consumer.accepting else None
        if consumer is not None and consumer.updates_on_device(spec.block) and index not in self._consumed:
            # (with accumulation the earlier backwards' sum is the weight's host `.grad`: it goes up and is added)
            land = self._update_on_device(index, a, b, home, consumer, None if direct else weight.grad)
            consumer.landed(land)  # the optimizer's worker waits for it and finishes the block
            self._consumed.add(index)
            self.grad_gemms += 1
            return
        target = home if direct else torch.empty_like(home, pin_memory=self.cuda)
        with torch.no_grad():
            if self.cuda:  # the GEMM into a staging buffer on the compute stream, its copy home on the D2H stream
                i, staging, _ = self._gemm(a, b, target)
                event = self._staging_free[i] = self._copy_home(target, staging)
            else:
                target.copy_(a.t() @ b)
                event = None
        self._deliver(_Landing(index, target, event, direct), consumer)
        self.grad_gemms += 1

    def _direct(self, index: int) -> bool:
        """The gradient is written straight into the weight's host buffer (it has no `.grad` to add to)."""
        return (self.layers[index].weight.grad is None and index not in self._consumed
                and not any(land.index == index for land in self._landing))

    def _deliver(self, land: _Landing, consumer) -> None:
        if consumer is not None:
            consumer.landed(land)  # the host optimizer applies it as it lands (train/host.py)
            self._consumed.add(land.index)
        else:
            self._landing.append(land)
        self.d2h_bytes += land.target.numel() * land.target.element_size()

    def _gather(self, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Gather the layer's gradient into its block's flat buffer; the block's last one sends it to its owner."""
        block = self.layers[index].block
        if block not in self._gathering:
            self._gathering[block] = (self._free_block_buffer(), set())
        i, held = self._gathering[block]
        view = self._layer_view(self._block_buffers[i], block, index)
        with torch.no_grad():
            if index in held:  # a layer run twice in the block: its gradients add up
                view.add_((a.t() @ b).to(view.dtype))
            elif a.dtype == view.dtype:
                torch.mm(a.t(), b, out=view)
            else:
                view.copy_(a.t() @ b)
        held.add(index)
        self.grad_gemms += 1
        if len(held) == len(self.trainable_positions(block)):
            self._send_block(block)

    def _layer_view(self, flat: torch.Tensor, block: int, index: int) -> torch.Tensor:
        lay = self.store.layout(block, precisions.FULL)[index - self.first_layer[block]]  # its place in the block
        return precisions.master().views(flat, lay)[0]

    def _free_block_buffer(self) -> int:
        """A free flat device buffer of the largest training block's gradients (two suffice unless graphs mix)."""
        busy = {i for i, _ in self._gathering.values()}
        i = next((k for k in range(len(self._block_buffers)) if k not in busy), None)
        if i is None:
            largest = max(precisions.master().layout(self.store.blocks[blk].layers)[1]
                          for blk in range(self.n_blocks) if self.trainable_positions(blk))
            self._block_buffers.append(torch.empty(largest, dtype=torch.uint8, device=self.device))
            self._block_free.append(None)
            i = len(self._block_buffers) - 1
        if self.cuda and self._block_free[i] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._block_free[i])  # its last copies are done
        self._block_buffers[i].zero_()  # a layer no rank computed this time sums to zero
        return i

    def _send_block(self, block: int) -> None:
        """Sum the block's gradients into its owner (a collective of every rank); the owner lands each layer."""
        i, held = self._gathering.pop(block)
        flat = self._block_buffers[i]
        for start, end, dtype in _dtype_runs(self.store.layout(block, precisions.FULL)):
            self.shards.reduce(flat[start:end].view(dtype), block)  # one sum per run of one dtype (mostly one)
        if not self.shards.mine(block):
            if self.cuda:
                self._block_free[i] = torch.cuda.current_stream(self.device).record_event()
            return
        consumer = self.consumer if self.consumer is not None and self.consumer.accepting else None
        for position in self.trainable_positions(block):
            index = self.first_layer[block] + position
            home = self._layer_view(self.host[block], block, index)
            direct = self._direct(index)
            target = home if direct else torch.empty_like(home, pin_memory=self.cuda)
            src, event = self._layer_view(flat, block, index), None
            if self.cuda:
                event = self._block_free[i] = self._copy_home(target, src)  # after the sum
            else:
                target.copy_(src)
            self._deliver(_Landing(index, target, event, direct), consumer)

    def _update_on_device(self, index: int, a: torch.Tensor, b: torch.Tensor, home: torch.Tensor,
                          consumer, partial: torch.Tensor | None) -> _Landing:
        """The gradient stays on the device: the optimizer steps the weight there (from it plus `partial`, the
        host's sum of the cycle's earlier backwards) and sends its states home."""
        with torch.no_grad():
            if self.cuda:
                i, staging, compute = self._gemm(a, b, home)
            else:
                i, staging, compute = None, a.t() @ b, None
            consumed, done, nbytes = consumer.update_on_device(index, staging, compute, partial)
        if i is not None:
            self._staging_free[i] = consumed  # free once the update read it, not when its results are home
        self.d2h_bytes += nbytes
        return _Landing(index, None, done, direct=True, updated=True)

    def _gemm(self, a: torch.Tensor, b: torch.Tensor, like: torch.Tensor):
        """dW = a^T b into the next staging buffer, on the compute stream: (its ring index, the buffer, the stream)."""
        compute = torch.cuda.current_stream(self.device)
        i = self._next_staging
        self._next_staging = (i + 1) % STAGING_RING
        staging = self._staging_buffer(i, like)
        if self._staging_free[i] is not None:
            compute.wait_event(self._staging_free[i])  # the copy that read it last is done
        if a.dtype == staging.dtype:
            torch.mm(a.t(), b, out=staging)
        else:
            staging.copy_(a.t() @ b)
        return i, staging, compute

    def _copy_home(self, target: torch.Tensor, src: torch.Tensor) -> "torch.cuda.Event":
        """`src` into host `target` on the D2H stream, after the compute stream's work so far: the landed event."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            target.copy_(src, non_blocking=True)
            return self.stream.record_event()

    def _staging_buffer(self, i: int, target: torch.Tensor) -> torch.Tensor:
        if not self._staging:  # allocated at the first gradient: LoRA runs never hold them
            largest = max(s.out_features * s.in_features * s.weight.element_size()
                          for s in self.layers if not s.experts)  # expert stacks never train (experts/stacks.py)
            self._staging = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(STAGING_RING)]
        n = target.numel() * target.element_size()
        return self._staging[i][:n].view(target.dtype).view(target.shape)

    def _queue_finish(self) -> None:
        """Run `finish` when this backward ends (once per backward; outside one, the caller finishes)."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self._queued_for:
            return
        self._queued_for = task
        torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        """Wait for the gradients in flight, then give each weight its `.grad` (set, or added to)."""
        self._queued_for = None
        if self.shards is not None:  # blocks some of whose training weights got no gradient (a layer skipped)
            for block in sorted(self._gathering, reverse=True):
                self._send_block(block)
            if not self.step_syncs:  # no attached optimizer: the next forward's first fetch syncs the ranks
                self.store.before_fetch = self._after_step
        landing, self._landing = self._landing, []
        for land in landing:
            self.apply(land)
        # The optimizer will write these masters, maybe without moving their version counter (torch's
        # fused CPU AdamW does not): mark them written now, so no stale slot or INT8 copy is served.
        for block in sorted({self.block_of(land.index) for land in landing}):
            self.store.mark_written(block)

    def _after_step(self) -> None:
        self.shards.sync(self.store, [b for b in range(self.n_blocks) if self.trainable_positions(b)])

    def optimizer_stepped(self) -> None:
        """An attached optimizer stepped (every rank steps it): the ranks sync here, not at a later fetch, so a
        rank that saves or evaluates alone after its step reads every owner's update."""
        if self.shards is not None and any(self.trainable_positions(b) for b in range(self.n_blocks)):
            self.store.before_fetch = None
            self._after_step()

    def forward_ran(self) -> None:
        """A forward op ran (not a recompute inside backward): the next gradient begins a new backward."""
        self._in_backward = False

    def apply(self, land: _Landing) -> None:
        """Once its copy is done, the gradient becomes the weight's `.grad` or is added to it (device-updated: none)."""
        if land.event is not None:
            land.event.synchronize()
        if land.updated:
            return
        weight = self.layers[land.index].weight
        # A landing meant to add may find no .grad: a host optimizer consumed it in between (a second
        # backward before its step, which step() then refuses). The gradient is then the landing's own.
        if land.direct or weight.grad is None:
            weight.grad = land.target
        else:
            weight.grad.add_(land.target)

    def block_of(self, index: int) -> int:
        return self.layers[index].block


def _dtype_runs(layouts) -> list[tuple[int, int, torch.dtype]]:
    """(start, end, dtype) byte ranges of a block's flat buffer, each a run of layers of one dtype in offset
    order (a block mixing dtypes, e.g. a layer transformers keeps in fp32, is summed run by run)."""
    runs: list[list] = []
    for lay in sorted(layouts, key=lambda lay: lay.offset):
        end = lay.offset + lay.out_features * lay.in_features * lay.dtype.itemsize
        if runs and runs[-1][2] == lay.dtype:
            runs[-1][1] = end
        else:
            runs.append([lay.offset, end, lay.dtype])
    return [tuple(r) for r in runs]


__all__ = ["GradLane", "STAGING_RING"]
