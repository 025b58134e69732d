"""Where offload's compiler preparation waits when the disk is busy with a slab's reads.

    python benches/preparation_probe.py --out benches/results/preparation_probe.json   (root, on a GPU machine)

Offload from a slab runs, on its calling thread, the compiler's preparation (compiler/startup/preparation.py: start
Inductor's compile workers, import the compiler, index the model's sources) while reader threads read the slab.
This bench reproduces that pair without a model: a 12 GB file of its own read by 8 threads in 36 MiB preads
(a Flux layer's rows) beside offload's own preparation, which times its parts. Each mode is a fresh process after the
page cache is emptied: `alone` (no reads: the baseline), `reads` (the reads beside it), `reads+ahead` (the
preparation's files read ahead first, as offload does, `CompilerPreparation.read_files_ahead`). The table
gives each part's seconds and their ratio to the same part alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("alone", "reads", "reads+ahead")
_CHUNK = 36 << 20


def child(mode: str, big: str) -> dict:
    """One mode, in this (fresh) process: the preparation's parts timed, the reads beside them."""
    import torch

    import torch_stagehand  # noqa: F401 - what a training script has imported before offload
    from torch_stagehand.compiler.startup.preparation import CompilerPreparation

    torch.zeros(1, device="cuda")
    preparation = CompilerPreparation(torch.nn.Linear(4, 4), torch.device("cuda"))
    out: dict = {"mode": mode}
    if mode == "reads+ahead":
        preparation.read_files_ahead()
        stats = preparation.files_read()
        out["read_ahead"] = {"files": stats.files, "bytes": stats.bytes, "s": round(stats.seconds, 3)}
    ended: list[float] = []
    readers = []
    start = time.perf_counter()
    if mode != "alone":
        size, fd = os.path.getsize(big), os.open(big, os.O_RDONLY)
        offsets, lock = iter(range(0, size, _CHUNK)), threading.Lock()

        def read() -> None:
            buf = bytearray(_CHUNK)
            while True:
                with lock:
                    offset = next(offsets, None)
                if offset is None:
                    ended.append(time.perf_counter() - start)
                    return
                os.preadv(fd, [buf], offset)

        readers = [threading.Thread(target=read) for _ in range(8)]
        for r in readers:
            r.start()
    preparation()  # offload's own preparation, which times its parts
    for r in readers:
        r.join()
    out["parts_s"] = {name: round(s, 3) for name, s in preparation.seconds.items()}
    out["parts_s"]["total"] = round(sum(preparation.seconds.values()), 3)
    out["reads_s"] = round(max(ended), 2) if ended else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results", "preparation_probe.json"))
    p.add_argument("--file", default="/tmp/stagehand-probe.bin", help="the 12 GB file the reads read (made once)")
    p.add_argument("--gib", type=int, default=11)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--child", metavar="MODE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # its result: the last line of its output
        print(json.dumps(child(args.child, args.file)), flush=True)
        return 0
    sys.path.insert(0, HERE)
    from _common import env_info, print_header, print_table, write_json
    from start_time import drop_page_cache

    env = print_header(env_info())
    if not os.path.exists(args.file):  # zeros written through to the disk (not a sparse file, which reads nothing)
        subprocess.run(["dd", "if=/dev/zero", f"of={args.file}", "bs=64M", f"count={args.gib * 16}", "oflag=direct"],
                       check=True, capture_output=True)
    runs = []
    for _ in range(args.repeat):
        for mode in MODES:
            page_cache = drop_page_cache()
            done = subprocess.run([sys.executable, __file__, "--file", args.file, "--child", mode], check=True,
                                  stdout=subprocess.PIPE, text=True)
            runs.append(dict(json.loads(done.stdout.strip().splitlines()[-1]), page_cache=page_cache))
            print(f"preparation_probe: {mode}: {runs[-1]['parts_s']}", flush=True)
    alone = {k: min(r["parts_s"][k] for r in runs if r["mode"] == "alone") for k in runs[0]["parts_s"]}
    rows = [{"mode": r["mode"], **{f"{k} s": v for k, v in r["parts_s"].items()},
             "x alone (total)": round(r["parts_s"]["total"] / alone["total"], 2), "reads s": r["reads_s"],
             "read ahead s": (r.get("read_ahead") or {}).get("s")} for r in runs]
    print_table(rows, title="the compiler's preparation, alone and beside a slab-sized read")
    write_json(args.out, {"env": env, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
