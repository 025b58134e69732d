"""Routed experts kept on the GPU between tokens, and fetched one block ahead from the next router's guess.

Generation reads only the experts its router picked (eager_path.py). A pool entry is one expert of one block (its
rows and scales of every stack, stored precision); blocks of one stack layout share a pool. Misses are copied in on
a copy stream, then the picked rows gathered into the dense stack the model reads. The next MoE block's router,
applied to this block's hidden states, guesses its picks, copied while this block computes (a wrong guess costs
bytes, never numbers). Every write into the pool waits for the gathers already issued; every gather waits for the
copies of the entries it reads. On the CPU copies are immediate and there are no streams."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from torch_stagehand.runtime import precision as precisions

# The least the pool holds: this many tokens' picks, twice (a forward's and the next block's prefetch).
FLOOR_TOKENS = 2
COPY_SECONDS = 10e-6  # what one small host-to-device copy costs beyond its bytes (issue and link latency)


@dataclass
class _Pool:
    """The entries of one stack layout: per stack, [entries, rows, cols] weights and [entries, rows] scales."""

    weights: list[torch.Tensor]
    scales: list[torch.Tensor | None]
    where: dict[tuple[int, int], int] = field(default_factory=dict)  # (block, expert) -> entry
    order: dict[int, "OrderedDict[int, None]"] = field(default_factory=dict)  # block -> its experts, oldest first
    free: list[int] = field(default_factory=list)
    ready: list = field(default_factory=list)  # entry -> the event after its last copy (CUDA; unrecorded: no wait)


def _layout_key(views: list[tuple[torch.Tensor, ...]]) -> tuple:
    """What a pool's entries hold: each stack's expert rows (and scales), their shapes and dtypes."""
    return tuple((tuple(v.shape[1:]), v.dtype) for stack in views for v in stack)


class ExpertCache:
    def __init__(self, model, layers, store, plan_driver, pool, *, first_layer: dict[int, int],
                 precision: Callable[[], dict[int, str]], device: torch.device, capacity_bytes: int | str):
        """`first_layer`: block -> the index of its first layer in `layers`; `precision()`: the map now (read);
        the plan driver's budget, plan and cost model size the cache and say when routing pays."""
        self.model, self.layers, self.store, self.plan_driver, self.pool = model, layers, store, plan_driver, pool
        self.first_layer, self.precision, self.device = first_layer, precision, device
        if capacity_bytes not in ("auto", 0):
            from torch_stagehand.runtime.conductor.costs import parse_bytes

            capacity_bytes = parse_bytes(capacity_bytes, "expert_cache_bytes")
        self.capacity_bytes = capacity_bytes
        self._pools: dict[tuple, _Pool] = {}
        self._routers: dict[int, tuple | None] = {}  # block -> (router weight, bias, next block) or None
        self._views: dict[tuple, tuple] = {}  # (block, precision) -> (host buffer's address, its stacks' views)
        self._seen: dict[int, str] = {}  # the precision map the pools were pruned for
        self._top_k: int | None = None  # the router's picks per token, as the last routed read saw them
        self._versions: dict[int, int | None] = {}  # block -> its master's version when its experts were cached
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._gathered = torch.cuda.Event() if cuda else None  # the compute stream's, after the last gather
        self.hits = self.misses = self.prefetched = self.prefetch_hits = self.copies = 0
        self._guessed: dict[int, set[int]] = {}  # block -> the experts prefetched for its next forward

    def stacks(self, block: int) -> list[int]:
        first = self.first_layer[block]
        return [i for i in range(first, first + len(self.store.blocks[block].layers)) if self.layers[i].experts]

    def _host_views(self, block: int) -> list[tuple[torch.Tensor, ...]]:
        """Each stack of the block in the host store as [experts, rows, cols] (and scales [experts, rows]), cached."""
        precision = self.precision()[block]
        host = self.store.buffer(block, precision)
        key = (block, precision)
        cached = self._views.get(key)
        if cached is not None and cached[0] == host.data_ptr():
            return cached[1]
        layouts = self.store.layout(block, precision)
        first = self.first_layer[block]
        out = []
        for i in self.stacks(block):
            lay = layouts[i - first]
            experts = self.layers[i].experts
            views = precisions.by_code(lay.code).views(host, lay)
            out.append(tuple(v.reshape(experts, lay.out_features // experts, *v.shape[1:]) for v in views))
        self._views[key] = (host.data_ptr(), out)
        return out

    def _fresh(self, block: int) -> tuple[list[tuple[torch.Tensor, ...]], _Pool]:
        """The host copy made current, the block's cached experts forgotten if its master was written since; returns
        the block's host views and its pool."""
        self.store.fetching()
        self.store.ensure_fresh(block, self.precision()[block])
        version = self.store.master_version(block)
        if self._versions.get(block, version) != version:
            self._forget(block)
        self._versions[block] = version
        views = self._host_views(block)
        return views, self._pool(block, views)

    def _forget(self, block: int) -> None:
        for pool in self._pools.values():
            for e in pool.order.pop(block, {}):
                pool.free.append(pool.where.pop((block, e)))
        self._guessed.pop(block, None)

    def _pool(self, block: int, views: list[tuple[torch.Tensor, ...]], top_k: int | None = None) -> _Pool:
        """The pool of the block's stack layout, made at the first routed read (`top_k`: picks per token)."""
        key = _layout_key(views)
        pool = self._pools.get(key)
        if pool is None:  # blocks of another layout share the cache's bytes
            held = sum(t.nbytes for p in self._pools.values() for t in (*p.weights, *p.scales) if t is not None)
            per_entry = sum(v[0].nbytes for stack in views for v in stack)
            experts = self.layers[self.stacks(block)[0]].experts
            self._top_k = top_k or self._top_k  # a prefetch may make the next layout's pool: the last read's
            floor = 2 * min(experts, FLOOR_TOKENS * (self._top_k or experts))
            n = max(floor, max(self._capacity(block) - held, 0) // max(per_entry, 1))
            device = self.device
            with torch.inference_mode(False):  # made under inference_mode, it could not be written outside it
                weights = [torch.empty(n, *stack[0].shape[1:], dtype=stack[0].dtype, device=device) for stack in views]
                scales = [torch.empty(n, *stack[1].shape[1:], dtype=stack[1].dtype, device=device)
                          if len(stack) > 1 else None for stack in views]
                ready = [torch.cuda.Event() for _ in range(n)] if self._stream is not None else []
            pool = self._pools[key] = _Pool(weights, scales, free=list(range(n)), ready=ready)
        return pool

    def _capacity(self, block: int) -> int:
        if isinstance(self.capacity_bytes, int):
            return self.capacity_bytes
        # "auto": what the budget leaves beside the plan's peak (or what this process held, if more: a long prompt
        # still streams whole blocks through the slots) and the dense stacks the model reads (eager_path.py), less 1/5
        limit = self.plan_driver.budget.limit if self.plan_driver.planning else None
        if limit is None or self.device.type != "cuda":
            return 0
        plan = self.plan_driver.plan
        held = max(plan.predicted_peak_bytes if plan is not None else 0, torch.cuda.max_memory_reserved(self.device))
        dense = sum(self.layers[i].weight.numel() * self.layers[i].weight.element_size() for i in self.stacks(block))
        return max(0, int((limit - held - dense) * 0.8))

    def _prune(self) -> None:
        """After a change of the precision map: a layout no block streams now gives its pool up."""
        if self._seen == self.precision():
            return
        self._seen = dict(self.precision())
        live = {_layout_key(self._host_views(b)) for b in range(len(self.store.blocks)) if self.stacks(b)}
        stale = [k for k in self._pools if k not in live]
        if stale and self._stream is not None:
            self._stream.synchronize()  # a prefetch may still be copying into the pool given back (rare: a new map)
        for key in stale:
            del self._pools[key]

    def worth_routing(self, block: int, picked: list[int], top_k: int) -> bool:
        """Is copying this forward's missing experts (bytes over the H2D bandwidth, plus `COPY_SECONDS` a copy)
        faster than one copy of the block? Never where its picks take more than half the pool (the other half is
        the next block's prefetch)."""
        self._prune()
        views = self._host_views(block)
        pool = self._pool(block, views, top_k)
        if 2 * len(picked) > len(pool.weights[0]):
            return False
        missing = [e for e in picked if (block, e) not in pool.where]
        per_expert = sum(v[0].nbytes for stack in views for v in stack)
        bps = self.plan_driver.cost_model.h2d_bps
        routed = len(missing) * (per_expert / bps + sum(len(s) for s in views) * COPY_SECONDS)
        return routed < self.store.nbytes(block, self.precision()[block]) / bps

    def read(self, index: int, picked: list[int], dtype: torch.dtype, out: torch.Tensor, memo: dict) -> torch.Tensor:
        """`out` (the stack's dense buffer) with the `picked` experts' rows written (`memo`: the forward's)."""
        block = self.layers[index].block
        stack = self.stacks(block).index(index)
        if ("entries", block) not in memo:
            memo[("entries", block)] = self._ensure(block, picked)
        entries = memo[("entries", block)]
        pool = self._pool(block, self._host_views(block))
        if not picked:
            return out
        if ("index", block) not in memo:  # the experts' places in the stack and in the pool: one async copy
            index = torch.tensor([picked, entries], dtype=torch.long)
            memo[("index", block)] = index.pin_memory().to(out.device, non_blocking=True) if out.is_cuda else index
        where, rows = memo[("index", block)]
        w = pool.weights[stack].index_select(0, rows)
        if pool.scales[stack] is not None:
            w = w.to(torch.float32) * pool.scales[stack].index_select(0, rows).unsqueeze(-1)
        out.index_copy_(0, where, w.to(dtype).view(len(picked), *out.shape[1:]))
        if self._stream is not None:
            self._gathered.record(torch.cuda.current_stream(self.device))
        return out

    def _ensure(self, block: int, picked: list[int]) -> list[int]:
        """Each picked expert's entry, the missing ones copied in; the compute stream waits for them."""
        views, pool = self._fresh(block)
        guessed = self._guessed.pop(block, set())
        missing = [e for e in picked if (block, e) not in pool.where]
        self.hits += len(picked) - len(missing)
        self.misses += len(missing)
        self.prefetch_hits += sum(1 for e in picked if e in guessed)
        self._copy_in(pool, block, missing, views, keep={(block, e) for e in picked})
        entries = []
        for e in picked:
            pool.order[block].move_to_end(e)
            entries.append(pool.where[(block, e)])
        if self._stream is not None:
            compute = torch.cuda.current_stream(self.device)
            for entry in entries:
                compute.wait_event(pool.ready[entry])
        return entries

    def _copy_in(self, pool: _Pool, block: int, experts: list[int], views, keep: set) -> None:
        """Copy these experts of `block` into entries (least recently used first out, never one in `keep`)."""
        if not experts:
            return
        stream = self._stream
        if stream is not None:
            stream.wait_event(self._gathered)  # the gathers already issued read the entries about to change
        pinned = views[0][0].is_pinned()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for e in experts:
                entry = self._take(pool, keep, block)
                for stack, host in enumerate(views):
                    pool.weights[stack][entry].copy_(host[0][e], non_blocking=pinned)
                    if pool.scales[stack] is not None:
                        pool.scales[stack][entry].copy_(host[1][e], non_blocking=pinned)
                    self.copies += len(host)
                    self.pool.stats.h2d_bytes += sum(v[e].nbytes for v in host)
                pool.where[(block, e)] = entry
                pool.order.setdefault(block, OrderedDict())[e] = None
                if stream is not None:
                    pool.ready[entry].record(stream)

    def _take(self, pool: _Pool, keep: set, block: int) -> int:
        """A free entry, or the one whose next use is furthest away: generation walks the blocks in a cycle, so the
        blocks just run are needed last (Belady's choice; LRU would evict each just before its use). Within a
        block, its least recently used expert; never one in `keep`."""
        if pool.free:
            return pool.free.pop()
        n = len(self.store.blocks)
        for distance in range(n - 1, -1, -1):  # 0 last: the block's own experts not read now
            other = (block + distance) % n
            for e in pool.order.get(other, ()):
                if (other, e) not in keep:
                    del pool.order[other][e]
                    return pool.where.pop((other, e))
        raise RuntimeError(f"stagehand: the expert cache's {len(pool.where)} entries are all in use by this forward")

    def router_guess(self, block: int, hidden: torch.Tensor | None, top_k: int) -> tuple[int, torch.Tensor] | None:
        """(next MoE block, its router's top-k experts for `hidden` on the device), or None."""
        found = self._router_after(block)
        if found is None or hidden is None or not hidden.is_floating_point():
            return None
        weight, bias, nxt = found
        if weight.device != hidden.device or hidden.shape[-1] != weight.shape[1]:
            return None
        logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype), weight, bias)
        return nxt, logits.topk(min(top_k, weight.shape[0]), dim=-1).indices.reshape(-1)  # the host dedupes

    def prefetch(self, block: int, experts: list[int], reading: tuple[int, list[int]]) -> None:
        """Copy the guessed experts of `block` not cached, without waiting; `reading`: (block, experts) read now."""
        views, pool = self._fresh(block)
        keep = {(reading[0], e) for e in reading[1]} | {(block, e) for e in experts}  # nor the guesses cached
        room = len(pool.weights[0]) - len(keep)
        missing = [e for e in experts if (block, e) not in pool.where][: max(room, 0)]
        self._copy_in(pool, block, missing, views, keep)
        self.prefetched += len(missing)
        self._guessed[block] = set(experts)

    def _router_after(self, block: int):
        """The next MoE block's router: a 2-D [experts, hidden] parameter of the module around its experts."""
        if block in self._routers:
            return self._routers[block]
        found = None
        nxt = next((b for b in range(block + 1, len(self.store.blocks)) if self.stacks(b)), None)
        if nxt is not None:
            spec = self.layers[self.stacks(nxt)[0]]
            experts_fqn = spec.fqn.rpartition(".")[0]
            parent = self.model.get_submodule(experts_fqn.rpartition(".")[0])
            own = {id(p) for p in self.model.get_submodule(experts_fqn).parameters()}
            for module in parent.modules():
                weight = module._parameters.get("weight")
                if (weight is not None and id(weight) not in own and weight.dim() == 2
                        and weight.shape[0] == spec.experts and weight.device.type == self.device.type):
                    bias = module._parameters.get("bias")
                    found = (weight, bias if bias is not None and bias.shape == (spec.experts,) else None, nxt)
                    break
        self._routers[block] = found
        return found

    def stats(self) -> dict:
        return {"entries": sum(len(p.weights[0]) for p in self._pools.values()), "hits": self.hits,
                "misses": self.misses, "prefetched": self.prefetched, "prefetch_hits": self.prefetch_hits,
                "copies": self.copies}

    def release(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # a prefetch still copying must not write into memory given back
        self._pools.clear()
        self._routers.clear()
        self._views.clear()
