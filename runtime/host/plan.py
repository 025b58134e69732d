"""Which host copies offload keeps where and what they cost (`plan_host`, resolving keep_full="auto"), whether the
machine has it (`preflight`, before any allocation), and `host_report` (`stats()["host"]`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch_stagehand.runtime import precision as precisions
from torch_stagehand.runtime.blocks import StreamedLayerSpec
from torch_stagehand.runtime.host.budget import MachineMemory, gib
from torch_stagehand.runtime.host.store import KEEP_FILE, KEEP_PINNED, KEEP_RAM, HostStore
from torch_stagehand.runtime.streamed import StreamedDtypeError

KEEP_AUTO = "auto"
KEEP_FULL_CHOICES = (KEEP_AUTO, KEEP_PINNED, KEEP_RAM, KEEP_FILE)
# keep_full="auto" keeps masters in RAM while everything fits in this share of the usable memory.
AUTO_RAM_SHARE = 0.7


class HostMemoryError(MemoryError):
    """The host copies offload would keep do not fit the machine; the message has the numbers and the way out."""


@dataclass
class HostPlan:
    keep_full: str
    pin: bool
    bytes: dict[str, int] = field(default_factory=dict)  # "int8 pinned", "bf16 ram", "bf16 file", ...
    freed_bytes: int = 0  # streamed weights in RAM now that the store replaces (they are freed as it fills)
    from_slab: bool = False
    node_ranks: int = 1  # ranks of this node sharing the store (host/node_store.py): its copies are held once

    def node_need(self) -> int:
        """Host memory the node still needs: the shared copies once, each rank's private ones (a disk tier's
        staging ring) once per rank, less the weights each rank frees."""
        private = sum(n for kind, n in self.bytes.items() if " staging " in kind)
        return self.ram_bytes - private + self.node_ranks * (private - self.freed_bytes)

    @property
    def pinned_bytes(self) -> int:
        return sum(n for kind, n in self.bytes.items() if kind.endswith(" pinned"))

    @property
    def ram_bytes(self) -> int:
        """Every byte the store holds in RAM, pinned or not (a file master is not counted)."""
        return sum(n for kind, n in self.bytes.items() if not kind.endswith((" file", " disk")))


def _block_bytes(layers: list[StreamedLayerSpec], precision: str) -> int:
    return precisions.get(precision).layout(layers)[1]


def _count(per_block, precision_map, keep_full: str, pin: bool, has_master, from_slab: bool,
           int8_on_disk: bool = False) -> dict[str, int]:
    where_pinned = "pinned" if pin else "ram"
    out: Counter = Counter()
    for block, layers in enumerate(per_block):
        streams = precision_map[block]
        master = _block_bytes(layers, precisions.FULL)
        if int8_on_disk:  # read from the slab at each fetch, through the staging ring
            out[f"{precisions.INT8} disk"] += _block_bytes(layers, precisions.INT8)
        elif streams != precisions.FULL or from_slab:
            out[f"{streams} {where_pinned}" if streams != precisions.FULL else f"{precisions.INT8} ram"] += (
                _block_bytes(layers, streams if streams != precisions.FULL else precisions.INT8))
        if not has_master[block]:
            continue
        if keep_full == KEEP_FILE:
            out[f"{precisions.FULL} file"] += master
            if streams == precisions.FULL:  # a flat copy derived from the file streams
                out[f"{precisions.FULL} {where_pinned}"] += master
        elif streams == precisions.FULL or keep_full == KEEP_PINNED:
            out[f"{precisions.FULL} {where_pinned}"] += master
        else:
            out[f"{precisions.FULL} ram"] += master
    return dict(out)


def plan_host(layers: list[StreamedLayerSpec], n_blocks: int, precision_map: dict[int, str], keep_full: str,
              pin: bool, machine: MachineMemory, has_master: list[bool], freed_bytes: int, has_file: bool,
              from_slab: bool = False, int8_on_disk: bool = False, training_blocks: tuple[int, ...] = ()) -> HostPlan:
    """Count the bytes of every copy kind, resolving keep_full="auto" from the RAM there is.
    `training_blocks`: blocks with a streamed weight that trains; each gets a host gradient buffer."""
    if keep_full not in KEEP_FULL_CHOICES:
        raise ValueError(f"offload: keep_full must be one of {', '.join(map(repr, KEEP_FULL_CHOICES))}, got {keep_full!r}")
    if keep_full == KEEP_FILE and not has_file:
        raise ValueError("offload: keep_full='file' keeps the full-precision weights in the model's safetensors "
                         "file: pass it as offload(..., checkpoint='model.safetensors' or its folder)")
    per_block = [[s for s in layers if s.block == b] for b in range(n_blocks)]
    if keep_full == KEEP_AUTO:
        keep_full = KEEP_RAM
        if any(p != precisions.FULL for p in precision_map.values()):
            ram = _count(per_block, precision_map, KEEP_RAM, pin, has_master, from_slab, int8_on_disk)
            if sum(ram.values()) - freed_bytes > AUTO_RAM_SHARE * machine.usable_bytes and has_file:
                keep_full = KEEP_FILE
    counted = _count(per_block, precision_map, keep_full, pin, has_master, from_slab, int8_on_disk)
    if training_blocks:  # full fine-tuning: the D2H gradients land in a buffer the size of the master
        counted[f"grad {'pinned' if pin else 'ram'}"] = sum(
            _block_bytes(per_block[b], precisions.FULL) for b in training_blocks)
    if int8_on_disk:
        from torch_stagehand.runtime.host.disk_tier import RING

        counted[f"{precisions.INT8} staging {'pinned' if pin else 'ram'}"] = RING * max(
            _block_bytes(layers_, precisions.INT8) for layers_ in per_block)
    return HostPlan(keep_full=keep_full, pin=pin, bytes=counted, freed_bytes=freed_bytes, from_slab=from_slab)


def preflight(plan: HostPlan, machine: MachineMemory, precision_map: dict[int, str], has_file: bool) -> None:
    """Raise HostMemoryError, before anything is allocated, when the plan does not fit the machine."""
    need = plan.node_need()
    problems = []
    if need > machine.usable_bytes:
        node = f" for the {plan.node_ranks} ranks of this node (one shared copy)" if plan.node_ranks > 1 else ""
        problems.append(f"it needs {gib(need)} more host memory{node} and {gib(machine.usable_bytes)} can be had")
    if plan.pin and machine.pinned_cap_bytes is not None and plan.pinned_bytes > machine.pinned_cap_bytes:
        problems.append(f"it pins {gib(plan.pinned_bytes)} and {machine.where} pins at most "
                        f"{gib(machine.pinned_cap_bytes)}")
    if not problems:
        return
    kinds = ", ".join(f"{kind} {gib(n)}" for kind, n in sorted(plan.bytes.items()))
    fixes = []
    if any(p == precisions.FULL for p in precision_map.values()):
        fixes.append("precision='int8' (half the pinned bytes of bf16)")
    if plan.keep_full != KEEP_FILE:
        master = sum(n for kind, n in plan.bytes.items() if kind.startswith(precisions.FULL + " "))
        how = "" if has_file else " with checkpoint='model.safetensors'"
        fixes.append(f"keep_full='file'{how} (the bf16 masters of int8 blocks, up to {gib(master)}, stay in the file)")
    if plan.from_slab and not any(kind.endswith(" disk") for kind in plan.bytes):
        fixes.append("Config(int8_tier='disk') (the INT8 rows stay in the slab file, read at each fetch)")
    if any(kind.startswith("grad ") for kind in plan.bytes):
        fixes.append("freeze some streamed weights (each training block holds a host gradient buffer the size "
                     "of its weights), or train LoRA adapters instead")
    fixes.append("fewer or smaller blocks on this machine, or a machine (or cgroup) with more memory")
    raise HostMemoryError(
        f"offload: the host store does not fit: {'; '.join(problems)} (keep_full={plan.keep_full!r}: {kinds}; "
        f"{gib(plan.freed_bytes)} of weights in RAM now are moved, not copied). Machine: {machine.describe()}. "
        f"To fit: {'; or '.join(fixes)}.")


def host_report(store: HostStore) -> dict:
    """stats()["host"]: where every host copy is, what is pinned (asked for, and locked to the page)."""
    kinds: Counter = Counter()
    requested = 0
    for block, bb in enumerate(store.blocks):
        for precision, buf in bb.buffers.items():
            arena = store._arena_of.get((block, precision))
            locked = arena is not None and arena.is_locked(buf)
            requested += buf.numel() if locked else 0
            kinds[f"{precision} {'pinned' if locked else 'ram'}"] += buf.numel()
        if bb.file_master is not None:
            kinds[f"{precisions.FULL} file"] += sum(w.numel() * w.element_size() for w in bb.file_master)
    for block, precision in store.on_disk:
        kinds[f"{precision} disk"] += store.nbytes(block, precision)
    tier = store.disk_tier
    if tier is not None:
        kinds[f"int8 staging {'pinned' if tier.arena.locked else 'ram'}"] = tier.arena.requested
        requested += tier.arena.requested if tier.arena.locked else 0
    return {
        **({"disk_tier": tier.stats.as_dict()} if tier is not None else {}),
        "keep_full": store.keep_full, "pinned_requested_bytes": requested,
        "pinned_locked_bytes": sum(a.locked_bytes for a in store.arenas), "host_allocations": len(store.arenas),
        "pin_refusals": sum(a.pin_refusals for a in store.arenas),  # left pageable at run time (host/arena.py)
        # The node's ranks share the store's allocations made at offload (host/node_store.py): these bytes once.
        "node_shared_bytes": 0 if store.node is None else store.node.shared_bytes,
        "node_ranks": 1 if store.node is None else store.node.local_size, "bytes_by_kind": dict(sorted(kinds.items())),
    }


def check_master_dtypes(layers: list[StreamedLayerSpec]) -> None:
    """Refuse, before anything moves, a streamed weight the master can not hold (float64, integer types)."""
    supported = precisions.master().dtypes
    for spec in layers:
        dtype = spec.weight.dtype
        if dtype not in supported:
            names = ", ".join(str(d).removeprefix("torch.") for d in supported)
            raise StreamedDtypeError(f"offload: {spec.fqn}.weight is {dtype}; streamed weights must be one of {names} "
                                     "(convert the model first, e.g. model.to(torch.bfloat16))")
