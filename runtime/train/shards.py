"""Full fine-tuning across ranks, ZeRO-2 style on the host: each training block has one owner per node (rank b mod
the node's ranks), which alone lands its gradient, keeps its optimizer states and steps its master.

A block's gradients are summed once (NCCL, gloo on the CPU) into its owner on a group of their own, at its last
training weight's gradient (train/grads.py gathers them). After a step (an attached optimizer's, else at the next
forward's first fetch) each rank rebuilds its blocks' copies in the node's shared store, waits for the node, and
marks the others' blocks written. Several nodes: every rank gets the sum, each node's owner keeps it; without a
node-shared store every rank owns every block."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.host.node_store import destroy_group, several_ranks


class GradShards:
    def __init__(self, group, world: int, node, device: torch.device):
        self.group = group
        self.device = torch.device(device)  # where a collective's tensors live (NCCL: this rank's GPU)
        self.world = world
        self.node = node  # NodeStore, or None: every rank owns every block
        # One node: the block's gradient goes to its owner alone; several: every rank gets the sum.
        self.to_owner = node is not None and node.local_size == world
        # How many ranks hold a block's summed gradient: its owner; every rank; its owner on each node.
        self.copies = 1 if self.to_owner else world if node is None else world // node.local_size
        self.reduces = 0

    @classmethod
    def create(cls, layers, node, device: torch.device) -> "GradShards | None":
        """The shards of a job of several ranks whose weights train or whose node shares the store (a collective)."""
        trains = any(spec.weight.requires_grad for spec in layers)
        if not several_ranks() or not (trains or node is not None):
            return None
        group = dist.new_group(backend="nccl" if torch.device(device).type == "cuda" else "gloo")
        return cls(group, dist.get_world_size(), node, device)

    def mine(self, block: int) -> bool:
        """Whether this rank lands the block's gradients, keeps its optimizer states and steps it."""
        return self.node is None or self.node.owns(block)

    def reduce(self, values: torch.Tensor, block: int) -> None:
        """Sum the block's gradients into its owner(s), who divide by the ranks (DDP's mean); the host never waits."""
        if self.to_owner:
            dist.reduce(values, dst=self.node.owner(block), group=self.group)
        else:
            dist.all_reduce(values, group=self.group)
        if self.mine(block):
            values.div_(self.world)
        self.reduces += 1

    def sum_over_blocks(self, value: float) -> float:
        """HostAdamW's squared norm: this rank's sum over its gradients made the sum over every block once."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return float(t) / self.copies

    def sync(self, store, training_blocks: list[int]) -> None:
        """After a step: the owners' blocks are written before anyone reads them."""
        if self.node is None:
            return  # every rank steps its own master
        for block in training_blocks:
            if self.mine(block):  # streamed copies rebuilt now (a torch optimizer leaves that to the next fetch)
                for precision in list(store.blocks[block].buffers):
                    if precision != precisions.FULL or store.blocks[block].file_master is not None:
                        store.ensure_fresh(block, precision)
        self.node.barrier()
        for block in training_blocks:
            if not self.mine(block):
                store.mark_written(block)  # another rank stepped it: slots and copies of it are stale here

    def close(self) -> None:
        group, self.group = self.group, None
        destroy_group(group, "the gradient group")
        if self.node is not None:
            self.node.close()
