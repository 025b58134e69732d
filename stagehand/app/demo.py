"""`stagehand demo`: LoRA-train a small causal LM through the backend, on text every machine has.

A random-init `LlamaForCausalLM` with a byte-level vocabulary (256: no tokenizer, nothing downloaded), trained
on the Python standard library's own source (`textdata.py`) as a user's LoRA run is: peft first (adapters and
the LM head train; the head makes the loss curve show within a CPU minute), then offload with half the blocks
int8, `torch.compile(backend="stagehand")`, `rt.attach(optimizer)`. The inner compiler is "eager" on a CPU
(Inductor's C++ compile takes minutes there), "inductor" on a GPU, where the model is larger and bf16.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class DemoShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    seq: int
    batch: int
    steps: int
    lr: float
    dtype: str
    inner: str
    corpus_bytes: int = 1_000_000


CPU_SHAPE = DemoShape(layers=4, hidden=128, intermediate=256, heads=4, kv_heads=2, seq=128, batch=8, steps=40,
                      lr=1e-2, dtype="float32", inner="eager")
GPU_SHAPE = DemoShape(layers=8, hidden=1024, intermediate=2816, heads=16, kv_heads=4, seq=256, batch=16, steps=200,
                      lr=2e-3, dtype="bfloat16", inner="inductor", corpus_bytes=4_000_000)


@dataclass
class DemoResult:
    losses: list[float]
    tokens_per_s: float
    h2d_bytes: int
    compile_seconds: float
    wall_seconds: float
    blocks: list[str]
    precision: dict[int, str]
    schedule_table: str
    summary: str
    files: dict[str, str] = field(default_factory=dict)
    shape: dict[str, Any] = field(default_factory=dict)

    @property
    def quarter(self) -> int:
        """Steps in a quarter of the run (at least one): what loss_drop averages over."""
        return max(1, len(self.losses) // 4)

    def loss_drop(self) -> tuple[float, float]:
        """(mean of the first quarter of the steps, mean of the last quarter)."""
        k = self.quarter
        return sum(self.losses[:k]) / k, sum(self.losses[-k:]) / k


def default_precision(n_blocks: int) -> dict[int, str]:
    """First half bf16, second half int8."""
    return {b: ("int8" if b >= n_blocks // 2 else "bf16") for b in range(n_blocks)}


def precision_schedule(pmap: dict[int, str], steps: int) -> dict[int, dict[int, str]]:
    """{step: map} the demo switches to: its map, then every block int8 from a third of the run, then the
    map's blocks swapped (bf16 <-> int8) from two thirds: the map changes between steps without recompiling."""
    if steps < 3 or set(pmap.values()) - {"bf16", "int8"}:
        return {}
    swapped = {b: ("int8" if p == "bf16" else "bf16") for b, p in pmap.items()}
    return {steps // 3: {b: "int8" for b in pmap}, 2 * steps // 3: swapped}


def build_model(shape: DemoShape, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype))
    model.requires_grad_(False)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, modules_to_save=["lm_head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation notes inside peft
        return get_peft_model(model, lora)  # peft BEFORE offload: adapters stay resident, the bases stream


def run(steps: int | None = None, device: str | None = None, out: str = "./stagehand-demo-out", seed: int = 0,
        precision: str | dict | None = None, inner: str | None = None, config=None, progress: bool = True,
        log=None, batch: int | None = None, seq: int | None = None) -> DemoResult:
    """Train, then write telemetry.jsonl, demo.png, schedule.txt and summary.json into `out`.

    steps / batch / seq default to the device's shape (CPU_SHAPE or GPU_SHAPE); precision defaults to
    `default_precision` (second half of the blocks int8).
    """
    import torch
    from tqdm.auto import tqdm

    import torch_stagehand as stagehand
    from torch_stagehand.config import Config
    from torch_stagehand.runtime.atomic_file import write_atomic

    from torch_stagehand.app.plots import demo_figure
    from torch_stagehand.app.textdata import ByteBatches, stdlib_corpus

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    overrides = {"steps": steps, "inner": inner, "batch": batch, "seq": seq}
    shape = DemoShape(**{**asdict(shape), **{k: v for k, v in overrides.items() if v is not None}})
    if min(shape.steps, shape.batch, shape.seq) < 1:
        raise ValueError(f"steps, batch and seq must be at least 1 (got {shape.steps}, {shape.batch}, {shape.seq})")

    os.makedirs(out, exist_ok=True)
    files = {"telemetry": os.path.join(out, "telemetry.jsonl"), "plot": os.path.join(out, "demo.png"),
             "schedule": os.path.join(out, "schedule.txt"), "summary": os.path.join(out, "summary.json")}
    if os.path.exists(files["telemetry"]):
        os.remove(files["telemetry"])  # the writer appends

    data, used = stdlib_corpus(shape.corpus_bytes)
    log(f"text: {data.numel() / 1e6:.2f} MB of Python stdlib source ({len(used)} files from {os.path.dirname(used[0])})")
    batches = ByteBatches(data, shape.batch, shape.seq, seed=seed)

    model = build_model(shape, seed)
    pmap = default_precision(shape.layers) if precision is None else precision
    config = config or Config()
    config.telemetry_file = files["telemetry"]
    rt = stagehand.offload(model, device=device, precision=pmap, config=config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    log(f"model: LlamaForCausalLM {shape.layers} blocks x hidden {shape.hidden}, {shape.dtype}, "
        f"{sum(p.numel() for p in trainable) / 1e6:.2f} M trainable (LoRA r=8 + lm_head), "
        f"{rt.stats()['host_bytes'] / 1e6:.1f} MB streamed weights in the host store")
    log("precision map: " + ", ".join(f"{b}:{p}" for b, p in rt.precision.items())
        + f"; device {device}, inner compiler {shape.inner}")

    optimizer = torch.optim.AdamW(trainable, lr=shape.lr, weight_decay=0.0)
    rt.attach(optimizer)
    compiled = torch.compile(model, backend="stagehand", options={"inner": shape.inner})

    losses: list[float] = []
    tokens_per_step = shape.batch * shape.seq
    timed_seconds, timed_tokens = 0.0, 0
    bar = tqdm(range(shape.steps), desc="compiling + step 0", unit="step", disable=not progress,
               dynamic_ncols=True, file=sys.stderr)
    switches = precision_schedule(dict(rt.precision), shape.steps)
    for step in bar:
        if step in switches:
            rt.set_precision(switches[step])  # compiled block variants are re-linked, not recompiled
        t0 = time.perf_counter()
        ids = batches.next().to(device)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # the demo reads the loss every step; the runtime never syncs
        if step > 0:  # step 0 includes the compile
            timed_seconds += time.perf_counter() - t0
            timed_tokens += tokens_per_step
        else:
            bar.set_description("training")
        rate = timed_tokens / timed_seconds if timed_seconds else 0.0
        bar.set_postfix_str(f"loss={losses[-1]:.3f} tok/s={rate:,.0f} streamed={rt.stats()['h2d_bytes'] / 1e6:,.1f}MB")
    bar.close()
    train_stats = rt.stats()
    records = [dict(r) for r in rt.telemetry.records]

    # The schedule of one training step, from explain() on one batch; its forward is not a training step, so the
    # telemetry file is closed first.
    rt.telemetry.close()
    rt.telemetry.path = None
    torch._dynamo.reset()
    report = stagehand.explain(model, input_ids=ids, labels=ids)
    rt.close()

    title = (f"stagehand demo: byte-level Llama ({shape.layers} blocks, hidden {shape.hidden}) on the Python stdlib, "
             f"{device.type}")
    demo_figure(losses, records, rt.blocks, files["plot"], title=title)
    write_atomic(files["schedule"], f"{report.summary()}\n\n{report.table()}\n")
    result = DemoResult(
        losses=losses, tokens_per_s=rate, h2d_bytes=train_stats["h2d_bytes"],
        compile_seconds=train_stats["compile_seconds"], wall_seconds=time.perf_counter() - t_start,
        blocks=list(rt.blocks), precision=rt.precision, schedule_table=report.table(), summary=report.summary(),
        files=files, shape=asdict(shape),
    )
    summary = {k: v for k, v in asdict(result).items() if k not in ("schedule_table",)}
    summary["stats"] = {k: v for k, v in train_stats.items() if not isinstance(v, dict)}
    write_atomic(files["summary"], json.dumps(summary, indent=1))
    return result


def print_result(result: DemoResult) -> None:
    """What `stagehand demo` prints at the end: the schedule, the loss drop, throughput, the files."""
    first, last = result.loss_drop()
    k = result.quarter
    print(f"\nschedule of one training step ({result.summary}):")
    print(result.schedule_table)
    print(f"\nloss: {first:.3f} (mean of the first {k} steps) -> {last:.3f} (mean of the last {k} steps)")
    print(f"throughput: {result.tokens_per_s:,.0f} tokens/s after the first step; "
          f"{result.h2d_bytes / 1e6:,.1f} MB streamed host->device in {len(result.losses)} steps; "
          f"compile {result.compile_seconds:.1f} s; total {result.wall_seconds:.1f} s")
    print("wrote:")
    for what, path in result.files.items():
        print(f"  {what:9s} {os.path.abspath(path)}")
