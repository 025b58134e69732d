"""`stagehand plan FOLDER`: a plan from a checkpoint folder's config alone (the model on the meta device): the
blocks and bytes offload would find, its host memory, the activations a step saves, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.app.cli import main
from torch_stagehand.app.plan import plan_folder


def _llama_folder(tmp_path, layers=4):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    folder = tmp_path / f"llama{layers}"
    config.save_pretrained(folder)
    return folder, config


def _kinds_by_precision(kinds: dict[str, int]) -> dict[str, int]:
    """Bytes per copy kind with where they live folded ("int8 pinned" and "int8 ram" are one int8 copy)."""
    out: dict[str, int] = {}
    for kind, n in kinds.items():
        out[kind.split()[0]] = out.get(kind.split()[0], 0) + n
    return out


def test_the_plan_counts_the_blocks_and_host_bytes_offload_holds(tmp_path):
    from transformers import LlamaForCausalLM

    folder, config = _llama_folder(tmp_path)
    plan = plan_folder(str(folder), "64MiB", precision="int8", train="lora", tokens=32)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    rt = stagehand.offload(model, device="cpu", precision="int8", verbose=False)
    try:
        assert plan.blocks == len(rt.blocks) == 4 and plan.block_lists == ["model.layers"]
        assert _kinds_by_precision(plan.host.bytes) == _kinds_by_precision(rt.stats()["host"]["bytes_by_kind"])
        assert plan.bytes_per_precision["int8"] < plan.bytes_per_precision["bf16"]
    finally:
        rt.close()


def test_activations_grow_with_the_tokens_and_the_budget_decides_the_plan(tmp_path):
    folder, _ = _llama_folder(tmp_path, layers=8)
    short = plan_folder(str(folder), "4GiB", train="full", tokens=64)
    long = plan_folder(str(folder), "4GiB", train="full", tokens=256)
    assert short.activations.startswith("measured") and long.activations.startswith("measured")
    assert long.vram["predicted_peak_bytes"] > short.vram["predicted_peak_bytes"]
    assert short.optimizer_bytes == long.optimizer_bytes > 0
    assert long.vram["predicted_peak_bytes"] < 4 * 2**30
    tight = plan_folder(str(folder), long.vram["predicted_peak_bytes"] // 2, train="full", tokens=256)
    assert len(tight.vram["streamed_blocks"]) + len(tight.vram["recomputed_blocks"]) > 0
    assert tight.vram["predicted_peak_bytes"] <= long.vram["predicted_peak_bytes"] // 2


def test_a_flux_config_is_planned_from_its_config_alone(tmp_path):
    folder = tmp_path / "flux"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 16, "num_layers": 2,
        "num_single_layers": 3, "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
        "pooled_projection_dim": 32, "guidance_embeds": False, "axes_dims_rope": [4, 6, 6]}))
    plan = plan_folder(str(folder), "1GiB", train="lora", tokens=64)
    assert plan.kind == "diffusers" and plan.blocks == 5
    assert plan.activations.startswith("measured")


def test_a_gpt2_lora_plan_and_an_inference_plan(tmp_path):
    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    GPT2Config(vocab_size=256, n_embd=64, n_layer=3, n_head=4, architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
    lora = plan_folder(str(folder), "1GiB", train="lora", tokens=32)  # Conv1D layers: [in, out] weights
    assert lora.blocks == 3 and lora.activations.startswith("measured")
    none = plan_folder(str(folder), "1GiB", train="none", tokens=32)
    assert none.vram["predicted_step_s"] < lora.vram["predicted_step_s"]  # no backward


def test_the_command_prints_the_plan_and_its_json(tmp_path, capsys):
    folder, _ = _llama_folder(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["plan", str(folder), "--vram-budget", "64MiB", "--tokens", "32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 blocks in model.layers" in text and "default" in text and "not this machine's" in text
    data = json.loads(out.read_text())
    assert data["blocks"] == 4 and data["vram"]["budget_bytes"] == 64 * 2**20
    assert data["host"]["ram_bytes"] == sum(data["host"]["bytes_by_kind"].values())  # no file master here


@pytest.mark.parametrize("make, argv_tail, message", [
    (lambda d: d, [], "no config.json"),
    (lambda d: ((d / "model_index.json").write_text("{}"), (d / "transformer").mkdir()), [],
     "a diffusers pipeline folder (model_index.json): plan its transformer"),
    (lambda d: (d / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"]}'), [],
     "unknown architecture 'NoSuchModelForCausalLM'"),
    (lambda d: (d / "config.json").write_text('{"_class_name": "NoSuchTransformer"}'), [],
     "unknown diffusers model class 'NoSuchTransformer'"),
    (lambda d: (d / "config.json").write_text("{not json"), [], "config.json: not JSON"),
    (lambda d: (d / "config.json").write_text("[]"), [], "config.json: not a model config (a JSON object)"),
    (lambda d: (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}'), [],
     "LlamaForCausalLM does not build from it"),
])
def test_bad_folders_are_one_line_errors_naming_the_file(tmp_path, capsys, make, argv_tail, message):
    folder = tmp_path / "model"
    folder.mkdir()
    make(folder)
    assert main(["plan", str(folder), "--vram-budget", "16GiB", *argv_tail]) == 2
    err = capsys.readouterr().err
    assert message in err and str(folder) in err and len(err.strip().splitlines()) == 1


def test_a_budget_below_the_smallest_plan_names_the_number(tmp_path, capsys):
    folder, _ = _llama_folder(tmp_path)
    assert main(["plan", str(folder), "--vram-budget", "16KiB"]) == 2
    err = capsys.readouterr().err
    assert "--vram-budget 16KiB" in err and "smallest plan" in err and len(err.strip().splitlines()) == 1
    assert main(["plan", str(folder), "--vram-budget", "16"]) == 2
    assert "--vram-budget" in capsys.readouterr().err
