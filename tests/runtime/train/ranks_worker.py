"""One rank of a gloo job that tests/runtime/train/test_multi_rank.py starts (a process per rank): it offloads a small Llama
with LoRA, trains one step under DistributedDataParallel through the backend, and writes what it saw (its
gradients against a single process on the whole batch, what its maps hold of the node's shared store) as JSON.

    python tests/runtime/train/ranks_worker.py SCENARIO RANK WORLD PORT OUT_DIR

SCENARIO: "ddp" (the step; gloo on the CPU), "ddp_cuda" (the step, NCCL, a GPU per rank, pinned pages, Inductor),
"fullft_host" / "fullft_torch" / "fullft_clip" / "fullft_fsdp" (full fine-tuning, three steps, HostAdamW / torch's
AdamW / HostAdamW clipping the global gradient norm / HostAdamW with FSDP2 sharding the resident parameters), "fsdp" (LoRA with FSDP2
sharding what does not stream; sharding a streamed weight refused), "files" (offload from a checkpoint and a slab:
each rank reads its blocks' rows),
"follower_fails" (rank 1 raises while its store is being filled), "leader_killed" (rank 0 is SIGKILLed after its
first shared allocation).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: _helpers
from _helpers import int8_reference  # noqa: E402

import torch_stagehand as stagehand  # noqa: E402
from torch_stagehand import Config  # noqa: E402
from torch_stagehand.runtime.host import store as host_store  # noqa: E402
from torch_stagehand.runtime.host import node_store

PRECISION = {0: "int8"}  # one block streams INT8 (the leader quantizes it), the rest their fp32 masters
PER_RANK = 2  # sequences per rank


def build():
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, lora)


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def in_shared_mapping(t: torch.Tensor) -> bool:
    """Whether `t`'s memory lies in a memfd:stagehand mapping of this process (read from /proc/self/maps)."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:stagehand" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= ptr < hi:
                    return True
    return False


def ddp_step(rank: int, world: int, device: str) -> dict:
    model = build()
    ids = torch.randint(0, 256, (world * PER_RANK, 16), generator=torch.Generator().manual_seed(1)).to(device)
    reference = int8_reference(model, PRECISION).to(device)  # a single process on the whole batch
    reference(input_ids=ids, labels=ids).loss.backward()
    want = lora_grads(reference)
    del reference

    cuda = device != "cpu"
    rt = stagehand.offload(model, device=device, precision=PRECISION, verbose=False, config=Config(node_timeout_s=60),
                           vram_budget="4GiB" if cuda else None)  # a plan: the cost model learns the shared link
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    compiled = torch.compile(ddp, backend="stagehand", options={} if cuda else {"inner": "eager"})
    mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
    loss = compiled(input_ids=mine, labels=mine).loss
    loss.backward()
    got = lora_grads(model)
    errors = {n: float((got[n] - w).abs().max() / w.abs().max()) for n, w in want.items()}
    dist.barrier()  # every rank has read the store's pages (the step streamed them) before the maps are read
    maps = node_store.mapped_bytes()
    dist.barrier()
    buffers = [buf for bb in rt.store.blocks for buf in bb.buffers.values()]
    host = rt.stats()["host"]
    return {"grad_rel_err": max(errors.values()), "grads_compared": len(errors), "loss": float(loss),
            "rss": maps["rss"], "pss": maps["pss"], "mappings": maps["mappings"],
            "host_bytes": rt.store.host_bytes(), "buffers_in_shared_mapping": all(map(in_shared_mapping, buffers)),
            "node_ranks": host["node_ranks"], "node_shared_bytes": host["node_shared_bytes"],
            "pinned_locked_bytes": host["pinned_locked_bytes"], "pinned_requested_bytes": host["pinned_requested_bytes"],
            "eager_linear_calls": rt.stats()["eager_linear_calls"],
            "h2d_source": rt.plan_driver.cost_model.measured.get("h2d"),
            "writer": rt.store.node is not None and rt.store.node.writer}


def full_finetune(rank: int, world: int, optimizer_kind: str, steps: int = 3, device: str = "cpu") -> dict:
    """Every weight trains; the streamed ones step on their block's owner (runtime/train/shards.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from torch_stagehand.optim import HostAdamW

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 256, (world * PER_RANK, 16), generator=torch.Generator().manual_seed(1)).to(device)
    reference = copy.deepcopy(model).to(device)  # one process, the whole batch, torch's AdamW
    # eps well above the rounding noise of a near-zero gradient: Adam's first steps are lr * sign(g) there,
    # and the ranks' sum of two half-batch gradients rounds differently from the whole batch's
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-3)
    clip = 0.5 if optimizer_kind == "clip" else None  # below the gradients' norm (2.8 at the first step): it clips
    for _ in range(steps):
        reference(input_ids=ids, labels=ids).loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()

    rt = stagehand.offload(model, device=device, verbose=False, config=Config(node_timeout_s=60))
    if optimizer_kind == "fsdp":  # FSDP2 shards the resident parameters; the streamed ones: train/shards.py
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (world,)), ignored_params=rt.streamed_parameters())
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(  # the resident ones; the streamed: train/shards.py
            model, device_ids=[rank] if device != "cpu" else None)
    compiled = torch.compile(wrapped, backend="stagehand", options={"inner": "eager"})
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3) if optimizer_kind == "torch"
           else HostAdamW(model.parameters(), lr=1e-3, eps=1e-3, max_grad_norm=clip))
    rt.attach(opt)  # the ranks sync at its step (HostAdamW attaches itself)
    mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
    for _ in range(steps):
        compiled(input_ids=mine, labels=mine).loss.backward()
        opt.step()
        opt.zero_grad()
    # No barrier: after its own step a rank reads every owner's update (the step synced the node), and one
    # rank evaluating alone (eagerly, no grad) waits for nobody.
    eval_err = None
    if rank == 0 and optimizer_kind != "fsdp":  # (FSDP's forward is a collective of every rank)
        with torch.no_grad():
            got, ref = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
        eval_err = float((got - ref).abs() / ref.abs())
    want = dict(reference.named_parameters())
    from torch.distributed.tensor import DTensor

    full = {n: (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).cpu()
            for n, p in model.named_parameters()}  # the streamed masters are on the host, the rest on the device
    errors = {n: float((p - want[n].detach().cpu()).abs().max() / want[n].detach().cpu().abs().max())
              for n, p in full.items()}
    streamed = {id(spec.weight) for spec in rt.layers}
    states = [n for n, p in model.named_parameters() if id(p) in streamed and p in opt.state and opt.state[p]]
    return {"param_rel_err": max(errors.values()), "params_compared": len(errors), "eval_rel_err": eval_err,
            "grad_buffer_blocks": sorted(rt.grads.host), "streamed_states": states,
            "reduces": rt.grads.shards.reduces, "node_ranks": rt.stats()["host"]["node_ranks"],
            "buffers_in_shared_mapping": all(map(in_shared_mapping, [b for bb in rt.store.blocks
                                                                      for b in bb.buffers.values()]))}


def fsdp_lora(rank: int, world: int) -> dict:
    """FSDP2 shards what does not stream (embeddings, head, norms, LoRA) while the blocks stream; sharding a
    streamed weight is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from torch_stagehand.runtime.streamed import ShardedStreamedWeightError

    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, 256, (world * PER_RANK, 16), generator=torch.Generator().manual_seed(1))
    mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
    out = {}
    wrong = build()  # every parameter sharded, the streamed weights too
    stagehand.offload(wrong, device="cpu", verbose=False)
    try:
        fully_shard(wrong, mesh=mesh)
        out["refused"] = None
    except ShardedStreamedWeightError as e:
        out["refused"] = str(e)

    model = build()
    reference = copy.deepcopy(model)
    reference(input_ids=ids, labels=ids).loss.backward()
    want = lora_grads(reference)
    rt = stagehand.offload(model, device="cpu", verbose=False)
    fully_shard(model, mesh=mesh, ignored_params=rt.streamed_parameters())
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    compiled(input_ids=mine, labels=mine).loss.backward()
    got = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
           for n, p in model.named_parameters() if p.requires_grad}
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    out.update(grad_rel_err=max(float((got[n] - w).abs().max() / w.abs().max()) for n, w in want.items()),
               grads_compared=len(want), sharded=len(sharded), eager_linear_calls=rt.stats()["eager_linear_calls"],
               streamed_sharded=sum(isinstance(p, DTensor) for p in rt.streamed_parameters()))
    return out


def from_files(out_dir: str) -> dict:
    """A model built on the meta device, offloaded from its checkpoint and INT8 slab (files.json names them): each
    rank reads the slab rows of the blocks it owns only, and every rank computes with all of them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from torch_stagehand.runtime.slab import SlabReader

    with open(os.path.join(out_dir, "files.json")) as f:
        files = json.load(f)
    reads = []
    read = SlabReader.read_layer_into

    def counted(self, name, *args, **kwargs):
        reads.append(name)
        return read(self, name, *args, **kwargs)

    SlabReader.read_layer_into = counted
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(files["checkpoint"])).eval()
    rt = stagehand.offload(meta, device="cpu", precision="int8", checkpoint=files["checkpoint"], slab=files["slab"],
                           verbose=False)
    ids = torch.tensor(files["ids"])
    with torch.no_grad():
        logits = meta(input_ids=ids).logits
    return {"logits": logits.tolist(), "rows_read": sorted({int(n.split(".")[2]) for n in reads}),
            "layers_read": len(reads), "node_ranks": rt.stats()["host"]["node_ranks"]}


def failed_offload(rank: int, scenario: str) -> dict:
    model = build()
    before = checksum(model)
    if scenario == "follower_fails" and rank == 1:
        adopt = host_store.HostStore.adopt_full

        def adopt_then_fail(self, block, source=None):
            if block == 2:
                raise RuntimeError("injected failure while filling block 2")
            return adopt(self, block, source)

        host_store.HostStore.adopt_full = adopt_then_fail
    if scenario == "leader_killed" and rank == 0:
        backing = node_store.NodeStore.backing

        def map_then_die(self, kind, nbytes):
            pages = backing(self, kind, nbytes)
            os.kill(os.getpid(), signal.SIGKILL)
            return pages

        node_store.NodeStore.backing = map_then_die
    out = {}
    try:
        stagehand.offload(model, device="cpu", precision=PRECISION, verbose=False, config=Config(node_timeout_s=60))
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        out["error"] = f"{type(e).__name__}: {e}"
    import gc

    gc.collect()
    out.update(intact=checksum(model) == before, mappings_after=node_store.mapped_bytes()["mappings"])
    return out


def main() -> None:
    scenario, rank, world, port, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    cuda = scenario.endswith("_cuda")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    if scenario.startswith("ddp"):
        result = ddp_step(rank, world, f"cuda:{rank}" if cuda else "cpu")
    elif scenario == "files":
        result = from_files(out_dir)
    elif scenario == "fsdp":
        result = fsdp_lora(rank, world)
    elif scenario == "fullft_cuda":
        result = full_finetune(rank, world, "host", device=f"cuda:{rank}")
    elif scenario.startswith("fullft"):
        result = full_finetune(rank, world, scenario.removeprefix("fullft_"))
    else:
        result = failed_offload(rank, scenario)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if scenario.startswith(("ddp", "fullft", "fsdp", "files")):
        # The scenario's models, compiled graphs and pending collective handles go while the interpreter is
        # whole: a gloo handle freed by its C++ thread during the interpreter's teardown aborts the process.
        torch._dynamo.reset()
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    # A failed scenario leaves its default group to the process's exit: the peer may be gone.


if __name__ == "__main__":
    main()
