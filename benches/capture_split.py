"""Where Dynamo's capture of a deep model goes: plain `torch.compile` against the offloaded model.

    python benches/capture_split.py --layers 28 --out benches/results/capture_split_cpu.json

A warm start loads every unit; what is left of its first step is Dynamo's capture of the whole
model (benches/start_time.py: 39 s of Flux's 51 on an H100). This bench says whose seconds those
are. Capture cost follows the number of ops Dynamo steps through, not their width, so a Qwen2 shape
of full depth and small width measures it on the CPU: a peft LoRA model compiled with
`backend="eager"` (plain: Dynamo's tracing and guards, no backend work) and the same model offloaded
and compiled with `backend="stagehand"` (`inner="eager"`: units compile as plain ATen, which the
table shows apart). Each mode is a fresh process; the first call (forward and backward) is profiled,
and the table gives Dynamo's bytecode tracing, its guard building and the backend's graph passes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time

# cProfile entries (file suffix, function) whose cumulative seconds are the table's parts.
PARTS = {"dynamo_tracing_s": ("torch/_dynamo/convert_frame.py", "trace_frame"),
         "dynamo_guards_s": ("torch/_dynamo/convert_frame.py", "build_guards"),
         "backend_graph_passes_s": ("compiler/backend.py", "stagehand_backend"),
         "units_compile_s": ("compiler/units.py", "_compile")}


def child(mode: str, layers: int) -> dict:
    import peft
    import torch
    from torch._dynamo.utils import compilation_time_metrics
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import torch_stagehand as stagehand

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if mode == "stagehand":
        stagehand.offload(model, device="cpu", verbose=False)
        compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    else:
        compiled = torch.compile(model, backend="eager")
    ids = torch.randint(0, 256, (1, 64))
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    compiled(input_ids=ids, labels=ids).loss.backward()
    profile.disable()
    out = {"mode": mode, "first_call_s": round(time.perf_counter() - t0, 2),
           "dynamo_compile_s": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 2)}
    stats = pstats.Stats(profile).stats  # {(file, line, function): (calls, ncalls, tottime, cumtime, callers)}
    for part, (suffix, function) in PARTS.items():
        out[part] = round(sum(v[3] for (f, _, fn), v in stats.items() if fn == function and f.endswith(suffix)), 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen2.5-7B has 28)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=["plain", "stagehand"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.layers)), flush=True)
        return 0
    from _common import env_info, print_header, print_table, write_json

    env = print_header()
    rows = []
    for mode in ("plain", "stagehand"):
        print(f"capture_split: {mode} ...", flush=True)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--layers", str(args.layers)],
                              capture_output=True, text=True, timeout=1800)
        line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"capture_split: the {mode} process failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        rows.append(json.loads(line[len("RESULT "):]))
    plain, ours = rows
    for r in rows:  # the baseline is the plain model's tracing, measured in this run
        r["tracing_x_plain"] = round(r["dynamo_tracing_s"] / plain["dynamo_tracing_s"], 2)
    print_table(rows, title=f"Dynamo's capture of a {args.layers}-layer Qwen2 shape, first call (seconds)")
    if args.out:
        write_json(args.out, {"env": env, "layers": args.layers, "rows": rows,
                              "backend_share_of_capture": round(ours["backend_graph_passes_s"] /
                                                                ours["dynamo_compile_s"], 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
