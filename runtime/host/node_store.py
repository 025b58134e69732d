"""One host store per node: the local ranks of a torch.distributed job share the streamed weights.

The node's first rank creates each host allocation as a memfd (not bounded by /dev/shm); the others map it through
``/proc/<leader pid>/fd/<fd>``. Each block has one writer, its owner (rank b mod the node's ranks). The ranks pass
the same exchanges (`all_gather_object` on a gloo group), one per shared allocation and one at offload's end
(`seal`); a rank that fails sends an abort instead, a dead one is seen when its connection closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from datetime import timedelta

import torch

from torch_stagehand.runtime.host.arena import map_memfd, new_memfd
from torch_stagehand.environment import env

log = logging.getLogger(__name__)


class NodeStoreError(RuntimeError):
    """The node's ranks could not share their host store (a rank failed or died, or their models differ)."""


class NodeStore:
    """This rank's part of its node's shared host store (made by `join`, used by `HostStore`)."""

    def __init__(self, group, rank: int, local_ranks: list[int], leader_pid: int):
        self.group = group
        self.rank = rank
        self.local_ranks = local_ranks
        self.leader_pid = leader_pid
        self.local_index = local_ranks.index(rank)
        self.shared_bytes = 0
        self.done = False  # sealed or aborted: no more exchanges
        self.link_bps: dict[str, float] = {}  # "h2d" / "d2h": bytes/s with every local rank copying at once
        self.link_source = ""
        self._fds: list[int] = []  # the leader's memfds, open until every rank has mapped them (seal)
        self._allocations = 0

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def writer(self) -> bool:
        """The node's first rank: it creates the memfds; the others map them."""
        return self.local_index == 0

    def describe(self) -> str:
        return (f"shared by the {self.local_size} ranks of this node; rank {self.rank} writes blocks "
                f"{self.local_index}, {self.local_index + self.local_size}, ...")

    def owner(self, block: int) -> int:
        """The rank that writes `block`'s buffers (and steps it under full fine-tuning)."""
        return self.local_ranks[block % self.local_size]

    def owns(self, block: int) -> bool:
        return self.owner(block) == self.rank

    def _exchange(self, item: tuple) -> list[tuple]:
        if self.done:
            raise NodeStoreError(f"rank {self.rank}: the node's shared host store is sealed; no allocation after "
                                 "offload can be shared")
        import torch.distributed as dist

        items: list = [None] * self.local_size
        try:
            dist.all_gather_object(items, item, group=self.group)
        except Exception as e:  # noqa: BLE001 - a rank that died: gloo raises when its connection closes
            self._stop()
            raise NodeStoreError(f"offload: rank {self.rank} lost the other ranks of its node during offload "
                                 f"(a rank died or stopped answering): {e}") from e
        for rank, got in zip(self.local_ranks, items):
            if got[0] == "abort":
                self._stop()
                raise NodeStoreError(f"offload failed on rank {rank} of this node: {got[1]}")
        return items

    def backing(self, kind: str, nbytes: int) -> torch.Tensor:
        """The pages of one host allocation of `nbytes` (page-aligned), the same on every rank of the node."""
        index = self._allocations
        self._allocations += 1
        fd, identity = None, None
        if self.writer:
            fd = new_memfd(kind, nbytes)
            self._fds.append(fd)
            st = os.fstat(fd)
            identity = (st.st_dev, st.st_ino)
        lead = self._exchange(("allocation", index, kind, nbytes, fd, identity))[0]
        if lead[1:4] != (index, kind, nbytes):
            raise NodeStoreError(
                f"offload: rank {self.rank}'s host allocation {index} is {kind!r} of {nbytes} bytes, rank "
                f"{self.local_ranks[0]}'s is {lead[2]!r} of {lead[3]} bytes: the ranks of a node must offload the "
                "same model with the same blocks and precision map (or Config(node_shared_store='off'))")
        mine = fd if self.writer else self._open_leaders(lead[4], lead[5], kind)
        try:
            pages = map_memfd(mine, nbytes)
        finally:
            if mine != fd:
                os.close(mine)  # the mapping keeps the pages
        self.shared_bytes += nbytes
        return pages

    def _open_leaders(self, fd: int, identity: tuple[int, int], kind: str) -> int:
        """The leader's memfd, opened through /proc and checked to be that very file (not another process's same fd)."""
        path = f"/proc/{self.leader_pid}/fd/{fd}"
        try:
            mine = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise NodeStoreError(
                f"offload: rank {self.rank} could not open its node's shared host store ({kind}, {path}): {e}. "
                "Config(node_shared_store='off') gives each rank a copy of its own") from e
        st = os.fstat(mine)
        if (st.st_dev, st.st_ino) != tuple(identity):
            os.close(mine)
            raise NodeStoreError(
                f"offload: {path} is not rank {self.local_ranks[0]}'s shared host store ({kind}): the ranks named "
                "one node do not see each other's processes; set STAGEHAND_NODE_NAME apart per machine or "
                "container, or Config(node_shared_store='off')")
        return mine

    def seal(self, device: torch.device, pinned: bool, keep_group: bool = False) -> None:
        """The end of offload on every rank of the node: every owner has written its pages, every rank may read
        them. On a GPU the host link is measured with every local rank copying at once. `keep_group`: full
        fine-tuning syncs the node's ranks after each step on its group (`barrier`)."""
        counts = {got[1] for got in self._exchange(("sealed", self._allocations))}
        if len(counts) > 1:
            self._stop()
            raise NodeStoreError(f"offload: the ranks of this node made {sorted(counts)} shared host allocations: "
                                 "they must offload the same model (or Config(node_shared_store='off'))")
        if torch.device(device).type == "cuda":
            self._measure_link(torch.device(device), pinned)
        self._stop()
        if not keep_group:
            self._leave()

    def barrier(self) -> None:
        """Every rank of the node gets here before any goes on (after offload: the node's group, kept)."""
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def _measure_link(self, device: torch.device, pinned: bool) -> None:
        from torch_stagehand.runtime.conductor.costs import cached_bandwidth, measure_bandwidth

        known = {d: cached_bandwidth(device, pinned, d, ranks=self.local_size) for d in ("h2d", "d2h")}
        have = self._exchange(("link", all(v is not None for v in known.values())))
        if all(got[1] for got in have):
            self.link_bps, self.link_source = known, f"cached ({self.local_size} ranks at once)"
            return
        for direction in ("h2d", "d2h"):
            self._exchange(("measure", direction))  # start together
            self.link_bps[direction] = measure_bandwidth(device, pinned, direction, ranks=self.local_size)
        self.link_source = f"measured ({self.local_size} ranks at once)"

    def abort(self, error: BaseException | str) -> None:
        """This rank's offload failed: tell the others at their next exchange (unless they know already)."""
        if not self.done:
            with contextlib.suppress(NodeStoreError):  # another rank failed too: everyone knows
                self._exchange(("abort", f"{type(error).__name__}: {error}" if isinstance(error, BaseException)
                                else str(error)))
        self.close()

    def close(self) -> None:
        self._stop()
        self._leave()

    def _stop(self) -> None:
        """No more exchanges: close the leader's memfds (the mappings keep their pages)."""
        self.done = True
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def _leave(self) -> None:
        """Drop the node's gloo group (each rank its own handle; nothing else is exchanged on it)."""
        group, self.group = self.group, None
        destroy_group(group, "the node group")


def node_name() -> str:
    """The host name, or STAGEHAND_NODE_NAME where the host names do not tell the nodes apart (containers)."""
    return env("STAGEHAND_NODE_NAME") or socket.gethostname()


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def several_ranks() -> bool:
    """Whether this process is one of several ranks of an initialized torch.distributed job."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def destroy_group(group, what: str) -> None:
    if group is None:
        return
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception as e:  # noqa: BLE001 - the default group may be gone already at exit
        log.debug("stagehand: %s was not destroyed: %s", what, e)


def join(config, device) -> NodeStore | None:
    """This rank's NodeStore when torch.distributed runs more than one rank on this node and they can share
    (`Config.node_shared_store`); None otherwise. A collective: every rank of the job calls it (offload)."""
    if config.node_shared_store == "off" or not several_ranks():
        return None
    import torch.distributed as dist

    why_not = "" if hasattr(os, "memfd_create") else "this platform has no memfd_create"
    timeout = timedelta(seconds=config.node_timeout_s)
    # Gloo groups of their own: the exchanges are a few small objects on the CPU, whatever the job's backend.
    everyone = dist.new_group(backend="gloo", timeout=timeout)
    hellos: list = [None] * dist.get_world_size()
    # A node: one name and one pid namespace (a rank must see the leader's process to open its memfd).
    dist.all_gather_object(hellos, ((node_name(), _pid_namespace()), os.getpid(), why_not), group=everyone)
    hosts = sorted({h for h, _, _ in hellos})
    per_node = [[r for r, (h, _, _) in enumerate(hellos) if h == host] for host in hosts]
    mine, _ = dist.new_subgroups_by_enumeration(per_node, timeout=timeout, backend="gloo")
    dist.destroy_process_group(everyone)
    rank = dist.get_rank()
    local = next(ranks for ranks in per_node if rank in ranks)
    refusals = [(r, hellos[r][2]) for r in local if hellos[r][2]]
    if len(local) == 1 or refusals:
        dist.destroy_process_group(mine)
        if refusals and config.node_shared_store == "on":
            r, why = refusals[0]
            raise NodeStoreError(f"offload: node_shared_store='on', but rank {r} can not share its host store: "
                                 f"{why}. Config(node_shared_store='auto') keeps a copy per rank there")
        if refusals:
            log.info("stagehand: each rank keeps its own host store: rank %d: %s", *refusals[0])
        return None
    return NodeStore(mine, rank, local, leader_pid=hellos[local[0]][1])


def mapped_bytes(pid: int | str = "self", name: str = "memfd:stagehand") -> dict[str, int]:
    """Rss and Pss bytes process `pid` maps of the mappings whose path contains `name`, from /proc/<pid>/smaps
    (Pss splits each shared page among the processes that map it: a node's ranks' Pss add up to the pages once)."""
    out = {"rss": 0, "pss": 0, "mappings": 0}
    counting = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):  # a mapping's first line: "start-end perms offset dev inode path"
                counting = name in line
                out["mappings"] += counting
            elif counting and head in ("Rss:", "Pss:"):
                out[head[:-1].lower()] += int(line.split()[1]) * 1024
    return out
