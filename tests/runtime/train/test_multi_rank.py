"""Several ranks on one node (gloo, a process per rank, tests/runtime/train/ranks_worker.py): LoRA under DistributedDataParallel
through the backend equals one process on the whole batch; so does full fine-tuning with each block's optimizer
on its owner; the node holds one host store, counted from the processes' own maps; a rank that fails or dies
during offload leaves every model as it was and no shared memory behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from torch_stagehand import Config
from torch_stagehand.runtime.host import node_store

WORKER = os.path.join(os.path.dirname(__file__), "ranks_worker.py")
PAGE_SLACK = 64 * 1024  # per rank: Pss is reported in kB, rounded per mapping


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failed_ranks(codes: list[int], logs: list[str]) -> str:
    """The exit code and the last lines of each rank that did not exit 0."""
    return "\n".join(f"rank {r} exited {code}:\n" + "\n".join(log.splitlines()[-40:])
                     for r, (code, log) in enumerate(zip(codes, logs)) if code != 0)


def run_ranks(scenario: str, world: int, tmp_path, nodes: int = 1) -> tuple[list[int], list[dict | None]]:
    """`world` ranks of `scenario`, spread over `nodes` named nodes (STAGEHAND_NODE_NAME; one machine here)."""
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STAGEHAND_CACHE_DIR": str(tmp_path / "cache")}
    per_node = world // nodes
    procs = [subprocess.Popen([sys.executable, WORKER, scenario, str(r), str(world), port, str(tmp_path)],
                              env={**env, "STAGEHAND_NODE_NAME": f"node{r // per_node}"} if nodes > 1 else env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    codes, logs = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            codes.append(p.returncode)
            logs.append(out)
    finally:
        for p in procs:
            p.kill()
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    if scenario.startswith(("ddp", "fullft", "fsdp", "files")):
        assert codes == [0] * world, _failed_ranks(codes, logs)
    return codes, results


@pytest.mark.parametrize("world", [2, 3])
def test_lora_ddp_equals_one_process_and_the_node_holds_one_store(world, tmp_path):
    _, ranks = run_ranks("ddp", world, tmp_path)
    for r in ranks:
        assert r["grads_compared"] == 4 * 2 * 2  # q and v, A and B, in 4 blocks
        assert r["grad_rel_err"] < 1e-5  # DDP's mean of the ranks' gradients against the whole batch's
        assert r["node_ranks"] == world and r["buffers_in_shared_mapping"]  # every buffer is the node's pages
    assert [r["writer"] for r in ranks] == [True] + [False] * (world - 1)
    store = ranks[0]["host_bytes"]
    # From the kernel: every rank maps the store's pages, and together they hold them once (Pss splits a
    # shared page among the processes that map it).
    total_pss = sum(r["pss"] for r in ranks)
    assert abs(total_pss - store) <= 0.02 * store + world * PAGE_SLACK, (total_pss, store)
    assert all(r["rss"] >= 0.5 * store for r in ranks)  # the followers read them too (a copy each would be >1x)
    assert ranks[1]["rss"] > 0 and ranks[1]["pss"] < 0.75 * ranks[1]["rss"]


@pytest.mark.parametrize("world, optimizer", [(2, "host"), (3, "torch"), (2, "clip"), (2, "fsdp")])
def test_full_fine_tuning_with_sharded_host_optimizer_equals_one_process(world, optimizer, tmp_path):
    """Three steps of every weight training: each block's gradients summed into its owner, which alone keeps
    its gradient buffer and optimizer states and steps it in the node's shared store; the others read it."""
    _, ranks = run_ranks(f"fullft_{optimizer}", world, tmp_path)
    streamed_blocks = 5
    for rank, r in enumerate(ranks):
        assert r["params_compared"] == 48 and r["param_rel_err"] < 1e-5  # measured 1.5e-7, read with no barrier
        assert r["reduces"] == 3 * streamed_blocks and r["node_ranks"] == world and r["buffers_in_shared_mapping"]
        owned = [b for b in range(streamed_blocks) if b % world == rank]
        assert r["grad_buffer_blocks"] == owned
        assert {int(n.split(".")[2]) for n in r["streamed_states"]} == set(owned)
    assert sum(len(r["streamed_states"]) for r in ranks) == 7 * streamed_blocks  # every weight's states, once
    if optimizer != "fsdp":
        assert ranks[0]["eval_rel_err"] < 1e-5  # rank 0 evaluated alone after the last step: nobody to wait for


def test_a_blocks_gradients_are_summed_in_runs_of_one_dtype():
    from torch_stagehand.runtime.train.grads import _dtype_runs
    from torch_stagehand.runtime.precision.layout import LayerLayout

    def lay(offset, out, inp, dtype):
        from torch_stagehand.runtime.precision.layout import DTYPE_CODES

        return LayerLayout(0, offset, out, inp, -1, False, DTYPE_CODES[dtype])

    layouts = [lay(0, 4, 8, torch.float32), lay(128, 4, 8, torch.bfloat16), lay(192, 2, 8, torch.bfloat16),
               lay(256, 4, 4, torch.float32)]
    assert _dtype_runs(layouts) == [(0, 128, torch.float32), (128, 224, torch.bfloat16), (256, 320, torch.float32)]
    assert _dtype_runs(layouts[1:3]) == [(128, 224, torch.bfloat16)]  # one dtype: one sum


def test_full_fine_tuning_on_two_nodes_of_two_ranks_equals_one_process(tmp_path):
    """Two nodes (named apart on this one machine): each node's ranks share a store of its own and own its blocks;
    a block's gradients are all-reduced over the four ranks and stepped by its owner on each node."""
    _, ranks = run_ranks("fullft_host", 4, tmp_path, nodes=2)
    for rank, r in enumerate(ranks):
        assert r["param_rel_err"] < 1e-5 and r["node_ranks"] == 2 and r["buffers_in_shared_mapping"]
        assert r["grad_buffer_blocks"] == [b for b in range(5) if b % 2 == rank % 2]  # the owner on its node
    assert sum(len(r["streamed_states"]) for r in ranks) == 2 * 7 * 5  # each node steps every weight once


def test_offload_from_files_reads_each_blocks_rows_once_per_node(tmp_path):
    """A meta model offloaded from its checkpoint and its INT8 slab on two ranks: each reads the slab rows of the
    blocks it writes into the node's store, and both compute what one process does."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    import torch_stagehand as stagehand
    from torch_stagehand.runtime.slab import build_slab_from_module

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path / "ckpt")
    slab = build_slab_from_module(model, tmp_path / "slab", "qwen_int8", "qwen-tiny", include_prefixes=("model.layers.",),
                                  progress=False, print_report=False, compare_quantizers=False).manifest_path
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    (tmp_path / "files.json").write_text(json.dumps({"checkpoint": str(tmp_path / "ckpt"), "slab": str(slab),
                                                     "ids": ids.tolist()}))
    with init_empty_weights():
        alone = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "ckpt")).eval()
    rt = stagehand.offload(alone, device="cpu", precision="int8", checkpoint=tmp_path / "ckpt", slab=slab, verbose=False)
    with torch.no_grad():
        want = alone(input_ids=ids).logits
    rt.close()
    _, ranks = run_ranks("files", 2, tmp_path)
    assert [r["rows_read"] for r in ranks] == [[0, 2], [1]]  # block b's rows by the node's rank b mod 2
    assert sum(r["layers_read"] for r in ranks) == 7 * 3  # every streamed layer once per node
    for r in ranks:
        assert r["node_ranks"] == 2 and torch.equal(torch.tensor(r["logits"]), want)


def test_fsdp2_shards_what_does_not_stream_and_refuses_a_streamed_weight(tmp_path):
    _, ranks = run_ranks("fsdp", 2, tmp_path)
    for r in ranks:
        assert "ignored_params=rt.streamed_parameters()" in r["refused"]  # fully_shard took the streamed weights
        assert r["grads_compared"] == 4 * 2 * 2 and r["grad_rel_err"] < 1e-5  # FSDP's mean: the whole batch's
        assert r["sharded"] > 0 and r["streamed_sharded"] == 0 and r["eager_linear_calls"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_lora_ddp_over_nccl_pins_the_nodes_shared_pages_in_every_rank(tmp_path):
    """Two GPUs: each rank page-locks the shared pages it streams (cudaHostRegister of the same memfd mapping),
    Inductor compiles the blocks, and DDP's NCCL all-reduce gives the whole batch's gradients."""
    _, ranks = run_ranks("ddp_cuda", 2, tmp_path)
    for r in ranks:
        assert r["grad_rel_err"] < 2e-2  # bf16-free fp32 model; Inductor's and NCCL's sums in another order
        assert r["buffers_in_shared_mapping"] and r["node_ranks"] == 2 and r["eager_linear_calls"] == 0
        assert r["pinned_locked_bytes"] > 0 and r["pinned_locked_bytes"] >= r["pinned_requested_bytes"]
        assert r["h2d_source"] in ("measured (2 ranks at once)", "cached (2 ranks at once)")  # the shared link
    assert abs(sum(r["pss"] for r in ranks) - ranks[0]["host_bytes"]) <= 0.02 * ranks[0]["host_bytes"] + 2 * PAGE_SLACK


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_full_fine_tuning_over_nccl_equals_one_process(tmp_path):
    """Two GPUs: each block's gradients summed into its owner over NCCL, landed from its device, stepped by
    HostAdamW in the node's shared store; three steps equal one process on the whole batch."""
    _, ranks = run_ranks("fullft_cuda", 2, tmp_path)
    for rank, r in enumerate(ranks):
        assert r["param_rel_err"] < 1e-4 and r["reduces"] == 15 and r["node_ranks"] == 2
        assert r["grad_buffer_blocks"] == [b for b in range(5) if b % 2 == rank]
    assert ranks[0]["eval_rel_err"] < 1e-4


def test_a_follower_failing_during_offload_undoes_every_rank(tmp_path):
    codes, (leader, follower) = run_ranks("follower_fails", 2, tmp_path)
    assert codes == [0, 0]
    assert follower["error"] == "RuntimeError: injected failure while filling block 2"
    assert leader["error"].startswith("NodeStoreError: offload failed on rank 1 of this node: RuntimeError: injected")
    assert leader["intact"] and follower["intact"]  # the models are as they were, weights and all
    assert leader["mappings_after"] == follower["mappings_after"] == 0


def test_the_leader_killed_during_offload_leaves_the_follower_whole_and_no_shared_memory(tmp_path):
    codes, (leader, follower) = run_ranks("leader_killed", 2, tmp_path)
    assert codes[0] == -9 and leader is None  # SIGKILL, after its first shared allocation
    assert codes[1] == 0
    # At the next exchange it finds the leader gone, or, if the leader died between the exchange and its open
    # of the leader's memfd, it cannot open it: either way it says so and undoes its offload.
    assert follower["error"].startswith(("NodeStoreError: offload: rank 1 lost the other ranks of its node",
                                         "NodeStoreError: offload: rank 1 could not open its node's shared"))
    assert follower["intact"] and follower["mappings_after"] == 0
    # The pages were a memfd's: nothing has a name in /dev/shm, and with both processes gone nothing maps them.
    assert not [n for n in os.listdir("/dev/shm") if "stagehand" in n]


def test_mapped_bytes_reads_rss_and_pss_of_the_named_mappings(tmp_path):
    fd = os.memfd_create("stagehand-test-maps")
    try:
        os.ftruncate(fd, 1 << 20)
        pages = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=1 << 20, dtype=torch.uint8)
        pages[: 1 << 19] = 1  # half the pages touched
        got = node_store.mapped_bytes(name="memfd:stagehand-test-maps")
        assert got["mappings"] == 1 and got["rss"] == got["pss"] == 1 << 19
        del pages
        assert node_store.mapped_bytes(name="memfd:stagehand-test-maps")["mappings"] == 0
    finally:
        os.close(fd)


def test_without_torch_distributed_there_is_no_node_store():
    assert node_store.join(Config(), torch.device("cpu")) is None
    assert node_store.join(Config(node_shared_store="on"), torch.device("cpu")) is None


def test_node_shared_store_is_validated():
    from torch_stagehand import ConfigError

    with pytest.raises(ConfigError, match="node_shared_store"):
        Config(node_shared_store="yes").validate()
    with pytest.raises(ConfigError, match="node_timeout_s"):
        Config(node_timeout_s=0).validate()
