"""The host AdamW step per kind of state: bytes a parameter against parameters stepped a second.

    python benches/host_adamw_states.py --params 64 --out benches/results/host_adamw_states_cpu.json

A full fine-tune whose optimizer does not fit the host at 12 bytes a parameter beside the bf16 weight
(Flux 12B: 144 GB) trades bytes for host time: a bf16 master (8), then bf16 or int8 moments (4, 2),
each rounded stochastically after every step. This steps `--params` million bf16 parameters (one block's worth of
weights of a 7-12B model is 200-400M) with `adamw_step` as HostAdamW does, per (master, states), on
every core torch uses, and gives the baseline's (fp32 master, fp32 moments) rate beside each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from _common import env_info, print_header, print_table, write_json

from torch_stagehand.runtime.train.host import STATE_BYTES, Hyper, Scratch, adamw_step, new_state

SETTINGS = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"), ("bf16", "int8"), ("fp32", "int8")]


def measure(params_m: int, master: str, states: str, repeats: int) -> dict:
    torch.manual_seed(0)
    shapes = [(4096, params_m * 2**20 // 4096 // 4)] * 4  # four Linear weights of one block
    weights = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    state = [new_state(w, master, states) for w in weights]
    hyper = Hyper(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
    scratch = (Scratch(), Scratch(), Scratch(), Scratch())
    generator = torch.Generator().manual_seed(0)
    adamw_step(weights, grads, state, hyper, master, scratch, generator)  # first touch of the pages
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        adamw_step(weights, grads, state, hyper, master, scratch, generator)
        seconds.append(time.perf_counter() - t0)
    n = sum(w.numel() for w in weights)
    s = statistics.median(seconds)
    master_bytes = 4 if master == "fp32" else 0
    # beside the bf16 weight itself (2 bytes a parameter, which the host keeps in any case)
    return {"master": master, "states": states, "optimizer_bytes_per_param": STATE_BYTES[states] + master_bytes,
            "params_m": round(n / 1e6, 1), "step_s": round(s, 4), "mparams_per_s": round(n / s / 1e6, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=64, help="millions of parameters stepped")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    env = print_header(env_info())
    rows = []
    for master, states in SETTINGS:
        print(f"host_adamw_states: master={master} states={states} ...", flush=True)
        rows.append(measure(args.params, master, states, args.repeats))
    base = rows[0]["mparams_per_s"]
    for r in rows:  # the baseline: fp32 master and moments, measured in this run
        r["x_fp32_rate"] = round(r["mparams_per_s"] / base, 2)
    print_table(rows, title=f"host AdamW, {rows[0]['params_m']}M bf16 parameters, {torch.get_num_threads()} threads")
    if args.out:
        write_json(args.out, {"env": env, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
