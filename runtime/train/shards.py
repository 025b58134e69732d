"""Full fine-tuning across ranks, ZeRO-2 style on the host: each training block has one owner per node, which
alone lands its gradient, keeps its optimizer states and steps its master.

Under torch.distributed every rank computes every block's weight gradients in its backward. DDP would
all-reduce them to every rank: each rank would then land every gradient on the host and step every master (N
times the host work, and with the node's shared store N writers of one master). Here a block's gradients are
summed once, on the GPU over NCCL (gloo on the CPU), into the block's owner (`NodeStore.owns`: the node's rank
b mod the node's ranks), which lands them on its host, steps the block, and rebuilds the block's streamed
copies in the node's shared store. The other ranks hold no gradient buffer and no optimizer state for it, and
their `.grad` of its weights stays None (a torch optimizer skips such a parameter).

One collective per block, issued when the block's last training weight has its gradient (train/grads.py gathers
them into one flat device buffer first), so every rank issues the same collectives in the same order whatever
its compiled graphs look like (plans may differ between ranks: a block one recomputes, another keeps). They
run on a process group of their own, never interleaved with DDP's all-reduces of the resident parameters.

After a step the owners write their blocks, and no rank may read those bytes before they are written. At the
step of an attached optimizer (`Runtime.attach`, which every rank calls; without one, at the first fetch of
the next forward: `HostStore.before_fetch`), every rank rebuilds the streamed copies of the blocks it owns,
waits for the node's other ranks (a barrier), and marks the blocks it does not own written (their version
counters move, so its slots and resident copies are fetched again). A rank that then saves or evaluates alone
waits for nobody.

Several nodes: each node has its own owners; a block's gradient is all-reduced over every rank and each
node's owner keeps it. Without a node-shared store (`node_shared_store="off"`) every rank owns every block:
its gradients are all-reduced, and each rank steps its own master (DDP's arithmetic, on the host).
"""

from __future__ import annotations

import torch

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
        """The shards of a job of several ranks whose streamed weights train, or whose node shares the store (a
        weight may be made trainable later); None otherwise. A collective."""
        trains = any(spec.weight.requires_grad for spec in layers)
        if not several_ranks() or not (trains or node is not None):
            return None
        import torch.distributed as dist

        group = dist.new_group(backend="nccl" if torch.device(device).type == "cuda" else "gloo")
        return cls(group, dist.get_world_size(), node, device)

    def mine(self, block: int) -> bool:
        """Whether this rank lands the block's gradients, keeps its optimizer states and steps it."""
        return self.node is None or self.node.owns(block)

    def reduce(self, values: torch.Tensor, block: int) -> None:
        """Sum `values` (gradients of the block) over the ranks into its owner(s), who divide them by the ranks
        (DDP's mean). On a GPU the compute stream waits for it; the host does not."""
        import torch.distributed as dist

        if self.to_owner:
            dist.reduce(values, dst=self.node.owner(block), group=self.group)
        else:
            dist.all_reduce(values, group=self.group)
        if self.mine(block):
            values.div_(self.world)
        self.reduces += 1

    def sum_over_blocks(self, value: float) -> float:
        """This rank's sum over the streamed gradients it holds (HostAdamW's squared norm), made the sum over every
        block once: summed over the ranks, less the copies of a block that several ranks hold."""
        import torch.distributed as dist

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
