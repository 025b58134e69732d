"""Peak memory of the streaming slab builder on a synthetic ~1 GB sharded BF16 checkpoint.

    python benches/slab_build.py [--size-gb 1.0] [--shards 4] [--quantizer mse|absmax]

Writes a transformer-like checkpoint (``blocks.N.attn.qkv.weight`` ... plus an
embedding, norms and biases, with a ``model.safetensors.index.json``) to a temp
dir, then runs `build_slab_from_checkpoint(..., blocks_only=True)` in a fresh
interpreter that records its resident memory: the baseline after imports, and
the peak during the build (VmHWM after resetting it through
``/proc/self/clear_refs``, and a 2 ms VmRSS sampling thread as a cross-check).
Target: peak - baseline < 300 MB. Prints a table and writes
benches/results/slab_build.json; also verifies the slab (SlabReader, full
sha256 + crc32 pass) and reports mse vs absmax cosine.

(benches/_common.py did not exist when this was written, so the table and JSON
helpers are inline.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TARGET_MB = 300
HERE = os.path.dirname(os.path.abspath(__file__))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def make_checkpoint(d: str, size_gb: float, shards: int, hidden: int = 2048, ffn: int = 8192) -> dict:
    import torch
    from safetensors.torch import save_file

    per_block = 2 * hidden * (3 * hidden + hidden + 2 * ffn)
    n_blocks = max(2, round(size_gb * 1e9 / per_block))
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def block(i):
        p = f"blocks.{i}."
        return {
            p + "norm1.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "attn.qkv.weight": w(3 * hidden, hidden), p + "attn.qkv.bias": w(3 * hidden),
            p + "attn.proj.weight": w(hidden, hidden), p + "attn.proj.bias": w(hidden),
            p + "norm2.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "mlp.fc1.weight": w(ffn, hidden), p + "mlp.fc1.bias": w(ffn),
            p + "mlp.fc2.weight": w(hidden, ffn), p + "mlp.fc2.bias": w(hidden),
        }

    groups = [list(range(n_blocks))[i::shards] for i in range(shards)]
    wmap, total = {}, 0
    for s, idx in enumerate(groups):
        tensors = {}
        if s == 0:
            tensors["embed.weight"] = w(8192, hidden)
        if s == shards - 1:
            tensors["final_norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for i in idx:
            tensors.update(block(i))
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, os.path.join(d, name), metadata={"format": "pt"})
        total += os.path.getsize(os.path.join(d, name))
        wmap.update({k: name for k in tensors})
        del tensors
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f)
    return {"blocks": n_blocks, "checkpoint_bytes": total, "shards": shards}


def child(ckpt: str, out: str, quantizer: str, result_path: str) -> None:
    """Runs in a fresh interpreter: baseline after imports, peak during the build."""
    import gc
    import threading

    import tabulate  # noqa: F401  (imported before the baseline: the builder's report uses them)
    import tqdm.auto  # noqa: F401

    from torch_stagehand.runtime.slab import build_slab_from_checkpoint

    gc.collect()
    baseline = _status_kb("VmRSS")
    try:  # reset VmHWM to the current RSS (Linux >= 4.0), so it measures the build only
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    peak_sampled = [baseline]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak_sampled[0] = max(peak_sampled[0], _status_kb("VmRSS"))
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    res = build_slab_from_checkpoint(ckpt, out, "bench", "synthetic", quantizer=quantizer, blocks_only=True,
                                     progress=False, print_report=True)
    seconds = time.perf_counter() - t0
    stop.set()
    th.join()
    hwm = _status_kb("VmHWM")
    peak = max(peak_sampled[0], hwm) if hwm_reset else peak_sampled[0]
    with open(result_path, "w") as f:
        json.dump({
            "baseline_rss_kb": baseline, "peak_rss_kb": peak, "peak_sampled_kb": peak_sampled[0],
            "vmhwm_kb": hwm, "vmhwm_reset": hwm_reset, "build_seconds": seconds,
            "slab_bytes": res.slab_bytes, "manifest": res.manifest_path, "summary": res.summary(),
        }, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--quantizer", default="mse", choices=["mse", "absmax"])
    ap.add_argument("--json", default=os.path.join(HERE, "results", "slab_build.json"))
    ap.add_argument("--child", nargs=4, metavar=("CKPT", "OUT", "QUANTIZER", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    from tabulate import tabulate

    with tempfile.TemporaryDirectory(prefix="slab_bench_") as tmp:
        ckpt, out = os.path.join(tmp, "ckpt"), os.path.join(tmp, "slab")
        os.makedirs(ckpt)
        t0 = time.perf_counter()
        info = make_checkpoint(ckpt, args.size_gb, args.shards)
        gen_s = time.perf_counter() - t0
        result_path = os.path.join(tmp, "child.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", ckpt, out, args.quantizer,
                        result_path], check=True)
        with open(result_path) as f:
            r = json.load(f)
        from torch_stagehand.runtime.slab import SlabReader

        t0 = time.perf_counter()
        with SlabReader(r["manifest"], verify="full") as reader:
            n_layers = len(reader.layers)
        verify_s = time.perf_counter() - t0
    mb = 1024.0
    delta_mb = (r["peak_rss_kb"] - r["baseline_rss_kb"]) / mb
    s = r["summary"]
    row = {
        "checkpoint_bytes": info["checkpoint_bytes"],
        "slab_bytes": r["slab_bytes"],
        "layers": n_layers,
        "build_seconds": round(r["build_seconds"], 2),
        "baseline_rss_mb": round(r["baseline_rss_kb"] / mb, 1),
        "peak_rss_mb": round(r["peak_rss_kb"] / mb, 1),
        "delta_mb": round(delta_mb, 1),
        "target_mb": TARGET_MB,
        "pass": delta_mb < TARGET_MB,
    }
    print()
    print(tabulate([[row["checkpoint_bytes"] / 2**20, row["slab_bytes"] / 2**20, row["layers"], row["build_seconds"],
                     row["baseline_rss_mb"], row["peak_rss_mb"], row["delta_mb"], TARGET_MB,
                     "PASS" if row["pass"] else "FAIL"]],
                   headers=["checkpoint MB", "slab MB", "layers", "build s", "baseline RSS MB", "peak RSS MB",
                            "delta MB", "target MB", "result"], floatfmt=".1f"))
    alt = "absmax" if args.quantizer == "mse" else "mse"
    print(tabulate([[q, s.get(f"cosine_{q}_mean"), s.get(f"cosine_{q}_min")] for q in (args.quantizer, alt)],
                   headers=["quantizer", "mean cosine", "min cosine"], floatfmt=".7f"))
    doc = {
        "bench": "slab_build",
        "what": "streaming build_slab_from_checkpoint(blocks_only=True) on a synthetic sharded bf16 checkpoint, "
                "fresh interpreter; RSS from /proc/self/status",
        "quantizer": args.quantizer,
        "checkpoint": {**info, "generate_seconds": round(gen_s, 1)},
        "result": row,
        "rss_detail_kb": {k: r[k] for k in ("baseline_rss_kb", "peak_rss_kb", "peak_sampled_kb", "vmhwm_kb",
                                             "vmhwm_reset")},
        "verify_full_seconds": round(verify_s, 2),
        "cosine": {k: v for k, v in s.items() if k.startswith(("cosine", "layers_where"))},
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }
    from torch_stagehand.runtime.atomic_file import write_atomic

    write_atomic(os.path.abspath(args.json), json.dumps(doc, indent=2) + "\n")  # never a torn results file
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
