"""Full fine-tuning of a model whose weights do not fit with their optimizer: stagehand against the engines people use.

    python benches/full_finetune.py --model qwen --budgets 24 16                       # every row, each its own process
    python benches/full_finetune.py --model qwen --rows stagehand torchao deepspeed2 deepspeed3
    python benches/full_finetune.py --model qwen --tiny --device cpu --rows stagehand  # a smoke test of the bench
    python benches/full_finetune.py --model flux --budgets 24 --rows stagehand --master bf16 --states int8 --checkpointing

Qwen2.5-7B shape (benches/models.py), sequence 2048, every parameter trained,
AdamW (lr 1e-5, weight decay 0.01), bf16 weights, no checkpointing unless the
plan recomputes. Each row runs in a fresh process (the host memory of one
engine must not count against the next), builds the model on the GPU with
random init, takes one warm-up step (compiles, calibrates) and `--steps`
timed ones:

- `stagehand`: `offload(model, vram_budget=...)` for each budget (re-planned in
  the one process), `stagehand.optim.HostAdamW` (fp32 master and moments on the
  host, blocks stepped as their gradients land), `torch.compile(backend=
  "stagehand")`. The three limits of the step are printed beside it: the H2D
  of the streamed weights and the D2H of their gradients at the pinned
  bandwidths measured in the same process, and the host optimizer's measured
  time per step.
- `stagehand_host`: the same with `device_update="off"`: every block steps on
  the host (`stagehand` lets HostAdamW move blocks' updates to the GPU, chosen
  from the costs its second step measured; the row says which and why).
- `stagehand_dpu`: every block on the host with `delayed_update=True` (ZeRO-Offload's
  one-step-delayed update: different math, the update overlaps the next step).
- `stagehand_eager`: `stagehand` with the inner compiler "eager" (no Inductor): what the
  compiler contributes, apart from what the offload design does.
  Every stagehand row keeps an fp32 master and fp32 moments of every parameter, streamed
  or resident (HostAdamW's defaults), as DeepSpeed's bf16 mode does; the row says where
  the resident parameters' states live (`resident_states`) and how many blocks the plan
  recomputes.
- `torchao`: torchao's `CPUOffloadOptimizer` (AdamW states and step on the CPU)
  with the whole model resident, compiled with Inductor: where the weights fit.
- `deepspeed2`: DeepSpeed ZeRO-2 with `offload_optimizer: cpu` (its CPU Adam,
  built on the machine), configured as DeepSpeed's ZeRO-Offload documentation recommends for
  speed: `pin_memory`, `overlap_comm`, `contiguous_gradients`, `reduce_scatter`,
  `round_robin_gradients`, bucket sizes 5e8, and its CPU Adam on every core the process may use
  (OMP_NUM_THREADS set before the process starts, and torch's threads; the launcher's
  `--bind_cores_to_rank` also pins the cores, which for one rank owning every core changes
  nothing). No activation recompute. `deepspeed2_ckpt`: the same with
  the model's own activation checkpointing (every layer recomputed). `deepspeed2_compile`: the same
  as `deepspeed2` with `engine.compile()` (Inductor). `deepspeed3`: ZeRO-3 with
  `offload_param` and `offload_optimizer` on the CPU. One process each, world size 1; the
  row holds DeepSpeed's version and its config.

Per row: step ms (median), first step s, GPU peak allocated and reserved,
host peak RSS, loss of each step. A row that does not fit (GPU or host) says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from _common import RESULTS, env_info, print_header, print_table, proc_status, write_json

GiB = 2**30
LR, WD = 1e-5, 0.01


# ---- one row (runs in its own process) -------------------------------------------------------------

def _build(args):
    from models import build_flux, build_qwen, qwen_config, qwen_inputs

    if args.model == "qwen" and args.layers:  # Qwen2.5-7B's width, fewer layers: a host that DeepSpeed fits
        from transformers import Qwen2ForCausalLM

        config = qwen_config(args.tiny)
        config.num_hidden_layers = args.layers
        with torch.device(args.device):
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        inputs, shape = qwen_inputs(config, args.tiny, args.device)
    else:
        model, inputs, shape = (build_qwen if args.model == "qwen" else build_flux)(args.tiny, args.device)
    model.requires_grad_(True)
    model.train()
    if args.checkpointing:  # the model's own activation checkpointing (diffusers / transformers)
        if hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.enable_gradient_checkpointing()
    return model, inputs, shape


def _loss(args, out) -> torch.Tensor:
    return out.loss if args.model == "qwen" else out[0].float().square().mean()


def _peaks(device: str) -> dict:
    out = {"peak_rss_gb": round(proc_status().get("VmHWM", 0) / 1e9, 2)}
    if device == "cuda":
        out.update(peak_gib=round(torch.cuda.max_memory_allocated() / GiB, 2),
                   peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2))
    return out


def _train_step(args, forward, inputs, opt):
    """One training step with a torch-style optimizer: forward, loss, backward, step, zero_grad."""
    def step():
        loss = _loss(args, forward(**inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def _timed(label: str, step, steps: int, device: str) -> dict:
    """The first step timed alone (compile, calibration), then `steps` timed steps."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    losses = [step()]
    sync()
    first_s = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, step_peaks = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        if device == "cuda":  # read after every step: stagehand resets the peak counter when it checks a new plan
            step_peaks.append(torch.cuda.max_memory_allocated() / GiB)
        print(f"  {label}: step {i + 1}/{steps} {times[-1]:.0f} ms", flush=True)
    row = {"mode": label, "step_ms": round(statistics.median(times), 1), "steps_ms": [round(t, 1) for t in times],
           "first_step_s": round(first_s, 1), "losses": [round(float(x), 4) for x in losses], **_peaks(device)}
    if step_peaks:  # the highest of the timed steps, not only of those after the last reset
        row.update(peak_gib=round(max(step_peaks), 2), peak_gib_steps=[round(p, 2) for p in step_peaks])
    return row


def row_stagehand(args, device_update: str = "auto", delayed: bool = False, inner: str | None = None) -> list[dict]:
    import torch_stagehand as stagehand
    from torch_stagehand.optim import HostAdamW
    from torch_stagehand.runtime.train.device import CHOOSE_AFTER_STEPS

    model, inputs, shape = _build(args)
    budgets = sorted(args.budgets, reverse=True)
    t0 = time.perf_counter()
    rt = stagehand.offload(model, device=args.device, vram_budget=f"{budgets[0]}GiB" if args.device == "cuda" else None,
                           verbose=False)
    offload_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt = HostAdamW(model.parameters(), lr=LR, weight_decay=WD, device_update=device_update, master=args.master,
                    states=args.states, delayed_update=delayed)
    where = "host + device update (auto)" if device_update == "auto" and not opt.device_update_note else \
        "host update only"
    if delayed:
        where = "one-step-delayed host update (DPU: other math)"
    if (args.master, args.states) != ("fp32", "fp32"):
        where += f", {args.master} master, {args.states} moments"
    states_s = time.perf_counter() - t0
    inner = inner or ("inductor" if args.device == "cuda" else "eager")
    if inner == "eager":
        where += ", inner compiler eager"
    step = _train_step(args, torch.compile(model, backend="stagehand", options={"inner": inner}), inputs, opt)
    streamed_bytes = sum(s.module.weight.numel() * s.module.weight.element_size() for s in rt.layers)
    from models import pinned_h2d_gbps

    h2d = pinned_h2d_gbps() if args.device == "cuda" else None
    d2h = pinned_h2d_gbps(direction="d2h") if args.device == "cuda" else None
    rows = []
    for i, budget in enumerate(budgets):
        if i and args.device == "cuda":
            rt.replan(vram_budget=f"{budget}GiB")
        step()  # a new plan's first step (its variants compile; calibration on the first)
        for _ in range(CHOOSE_AFTER_STEPS):  # "auto" chooses the device blocks after its host-timed steps:
            if device_update != "auto" or opt.device_update_note or opt.device_choice:  # the steps measured
                break                                                                    # below come after it
            step()
        states_in = lambda: opt.device.bytes_in if opt.device is not None else 0  # noqa: E731
        stats0, host0, overlapped0, d2h0 = rt.stats(), opt.host_seconds, opt.blocks_stepped_in_backward, rt.grads.d2h_bytes
        in0 = states_in()
        row = _timed(f"stagehand HostAdamW, {where}, vram_budget {budget} GiB", step, args.steps, args.device)
        after = rt.stats()
        n = args.steps + 1  # _timed runs a first step too
        # the weights fetched and the states of the blocks stepped on the device: one link
        h2d_gb = (after["h2d_bytes"] - stats0["h2d_bytes"] + states_in() - in0) / n / 1e9
        d2h_gb = (rt.grads.d2h_bytes - d2h0) / n / 1e9
        host_opt_ms = (opt.host_seconds - host0) / n * 1e3
        row.update(budget_gib=budget, h2d_gb_step=round(h2d_gb, 2), d2h_grad_gb_step=round(d2h_gb, 2),
                   host_optimizer_ms=round(host_opt_ms, 1),
                   blocks_stepped_in_backward_per_step=round((opt.blocks_stepped_in_backward - overlapped0) / n, 1),
                   plan=after.get("plan"), resident_blocks=after.get("resident_blocks"),
                   recomputed_blocks=after.get("planned_recompute_blocks"),
                   predicted_step_ms=after.get("predicted_step_ms"), offload_s=round(offload_s, 1),
                   optimizer_states_s=round(states_s, 1), streamed_gb=round(streamed_bytes / 1e9, 2),
                   device_update=device_update, device_blocks=sorted(opt.device_blocks),
                   device_choice=opt.device_choice, device_update_note=opt.device_update_note,
                   master=args.master, states=args.states, checkpointing=args.checkpointing, inner=inner,
                   resident_states=opt.resident_lane.place(opt._resident),
                   recompute=f"planned: {after.get('planned_recompute_blocks')} of {len(rt.blocks)} blocks")
        if h2d:
            row.update(h2d_gbps=round(h2d, 1), d2h_gbps=round(d2h, 1),
                       limit_h2d_ms=round(h2d_gb / h2d * 1e3, 1), limit_d2h_ms=round(d2h_gb / d2h * 1e3, 1),
                       limit_host_optimizer_ms=round(host_opt_ms, 1))
            row["slowest_limit_ms"] = max(row["limit_h2d_ms"], row["limit_d2h_ms"], row["limit_host_optimizer_ms"])
            row["x_slowest_limit"] = round(row["step_ms"] / row["slowest_limit_ms"], 2)
        rows.append(row)
    rt.close()
    return rows


def row_torchao(args) -> list[dict]:
    from torchao.optim import CPUOffloadOptimizer

    model, inputs, _ = _build(args)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD, fused=True)
    step = _train_step(args, torch.compile(model), inputs, opt)
    return [_timed("torchao CPUOffloadOptimizer (model resident, Inductor)", step, args.steps, args.device)]


def _deepspeed_config(stage: int) -> dict:
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
            "round_robin_gradients": True, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "wall_clock_breakdown": False}


def _cpu_adam_threads() -> dict:
    """DeepSpeed's CPU Adam runs on OpenMP: as many threads as the cores this process may use (run_row sets
    OMP_NUM_THREADS before the process starts; torch's own threads follow here)."""
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    return {"cores": cores, "omp_num_threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or None}


def row_deepspeed(args, stage: int, checkpointing: bool = False, compiled: bool = False) -> list[dict]:
    import deepspeed

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                       ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    binding = _cpu_adam_threads()
    deepspeed.init_distributed()
    args.checkpointing = args.checkpointing or checkpointing
    model, inputs, _ = _build(args)
    config = _deepspeed_config(stage)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if compiled:
        engine.compile()

    def step():
        loss = _loss(args, engine(**inputs))
        engine.backward(loss)
        engine.step()
        return loss.detach()

    label = "DeepSpeed ZeRO-2, offload_optimizer cpu" if stage == 2 else \
        "DeepSpeed ZeRO-3, offload_param + offload_optimizer cpu"
    label += ", model checkpointing" if args.checkpointing else ""
    label += ", engine.compile() (Inductor)" if compiled else ""
    row = _timed(label, step, args.steps, args.device)
    row.update(deepspeed=deepspeed.__version__, deepspeed_config=config, binding=binding, compiled=compiled,
               checkpointing=args.checkpointing, master="fp32", states="fp32",
               recompute="every layer (model checkpointing)" if args.checkpointing else "none")
    return [row]


ROWS = {"stagehand": row_stagehand, "stagehand_host": lambda a: row_stagehand(a, "off"),
        "stagehand_eager": lambda a: row_stagehand(a, inner="eager"),
        "stagehand_dpu": lambda a: row_stagehand(a, "off", delayed=True), "torchao": row_torchao,
        "deepspeed2": lambda a: row_deepspeed(a, 2), "deepspeed2_ckpt": lambda a: row_deepspeed(a, 2, checkpointing=True),
        "deepspeed2_compile": lambda a: row_deepspeed(a, 2, compiled=True), "deepspeed3": lambda a: row_deepspeed(a, 3)}


# ---- the driver: one process per row ---------------------------------------------------------------

def run_row(name: str, args) -> list[dict]:
    """Run one row in a fresh process; its rows, or one row saying why it failed (out of memory, an error)."""
    part = os.path.join(args.workdir, f"row_{name}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--row", name, "--part", part, "--model", args.model,
           "--device", args.device, "--steps", str(args.steps), "--budgets", *map(str, args.budgets)]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--layers", str(args.layers)] if args.layers else []
    cmd += ["--master", args.master, "--states", args.states] + (["--checkpointing"] if args.checkpointing else [])
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        env = dict(os.environ, OMP_NUM_THREADS=str(len(os.sched_getaffinity(0)))) if name.startswith("deepspeed") \
            else None
        proc = subprocess.run(cmd, timeout=args.row_timeout, text=True, capture_output=False, env=env)
    except subprocess.TimeoutExpired:
        return [{"mode": name, "error": f"did not finish in {args.row_timeout} s"}]
    if proc.returncode == 0 and os.path.exists(part):
        with open(part) as f:
            return json.load(f)
    why = "killed (host out of memory?)" if proc.returncode in (-9, 137) else f"exit status {proc.returncode}"
    return [{"mode": name, "error": why, "seconds": round(time.perf_counter() - t0, 1)}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["qwen", "flux"], default="qwen")
    parser.add_argument("--budgets", type=float, nargs="+", default=[24, 16])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=0, help="Qwen: this many layers of Qwen2.5-7B's width")
    parser.add_argument("--master", choices=["fp32", "bf16"], default="fp32", help="HostAdamW's master")
    parser.add_argument("--states", choices=["fp32", "bf16", "int8"], default="fp32", help="HostAdamW's moments")
    parser.add_argument("--checkpointing", action="store_true", help="the model's own activation checkpointing")
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="/tmp/stagehand-fullft")
    parser.add_argument("--row-timeout", type=int, default=420)
    parser.add_argument("--out", default=os.path.join(RESULTS, "full_finetune_qwen.json"))
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.row:  # a child: one row, written to --part
        if args.device == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(False)  # its backward fails at large shapes on torch 2.11
        rows = ROWS[args.row](args)
        with open(args.part, "w") as f:
            json.dump(rows, f)
        return
    info = print_header(env_info())
    os.makedirs(args.workdir, exist_ok=True)
    rows = [r for name in args.rows for r in run_row(name, args)]
    peers = [r["step_ms"] for r in rows if r.get("step_ms") and r["mode"].startswith("DeepSpeed")]
    best_peer = min(peers) if peers else None
    for r in rows:
        if best_peer and r.get("step_ms"):
            r["x_best_deepspeed"] = round(r["step_ms"] / best_peer, 2)
    cols = ["mode", "step_ms", "x_best_deepspeed", "recompute", "resident_states", "device_blocks", "peak_gib", "peak_reserved_gib", "peak_rss_gb", "first_step_s",
            "limit_h2d_ms", "limit_d2h_ms", "limit_host_optimizer_ms", "x_slowest_limit", "error"]
    print_table([[r.get(c) for c in cols] for r in rows], headers=cols,
                title=f"Full fine-tune, {args.model} ({'tiny' if args.tiny else 'full size'}), AdamW, every parameter")
    write_json(args.out, {"env": info, "model": args.model, "tiny": args.tiny, "layers": args.layers or None,
                          "master": args.master, "states": args.states, "checkpointing": args.checkpointing,
                          "steps": args.steps, "lr": LR, "rows": rows})


if __name__ == "__main__":
    main()
