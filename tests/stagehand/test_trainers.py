"""HF Trainer (TrainingArguments(torch_compile_backend="stagehand")) and an accelerate loop train a
model offloaded before they wrap it; a run resumed from a checkpoint ends where the straight run does.
Each runs the example script as a user would, on a tiny checkpoint saved first."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from test_examples import run_example, save_tiny_llama

pytest.importorskip("accelerate")


def _adapter(path):
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(path)
    else:
        tensors = torch.load(path, map_location="cpu")
    return {k: v for k, v in tensors.items() if "lora_" in k}


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys() and a
    for k in a:  # a resumed run replays the same steps: measured bitwise equal (CPU, torch 2.13, 3 seeds)
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_llama(folder)
    return folder


def test_hf_trainer_compiles_with_stagehand_saves_and_resumes(tiny_llama, tmp_path):
    common = ["--steps", "4", "--save-steps", "2", "--seq", "32"]
    out = run_example("hf_trainer.py", str(tiny_llama), "--out", str(tmp_path / "a"), *common)
    assert "stagehand: first step took" in out  # the optimizer was attached: the runtime saw the steps
    assert re.search(r"global step 4; stagehand ran 4 steps here, streamed (?!0\.0 MB)[\d.]+ MB", out)
    # the Trainer's torch.compile took the documented path: each graph one block, the code around them eager
    graphs = re.search(r"compiled graphs \[(.*)\]", out).group(1).split(", ")
    assert graphs and set(graphs) == {"'block'"}
    assert (tmp_path / "a" / "checkpoint-2" / "adapter_model.safetensors").is_file()

    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    out = run_example("hf_trainer.py", str(tiny_llama), "--out", str(tmp_path / "b"), "--resume", *common)
    assert "global step 4; stagehand ran 2 steps here" in out  # resumed at step 2
    _assert_same(_adapter(tmp_path / "a" / "checkpoint-4" / "adapter_model.safetensors"),
                 _adapter(tmp_path / "b" / "checkpoint-4" / "adapter_model.safetensors"))


def test_accelerate_loop_compiles_with_stagehand_saves_and_resumes(tiny_llama, tmp_path):
    common = ["--steps", "4", "--save-every", "2", "--seq", "32"]
    out = run_example("accelerate_loop.py", str(tiny_llama), "--out", str(tmp_path / "a"), *common)
    assert "stagehand: first step took" in out and "stagehand ran 4 steps here" in out

    shutil.copytree(tmp_path / "a" / "step-2", tmp_path / "b" / "step-2")
    out = run_example("accelerate_loop.py", str(tiny_llama), "--out", str(tmp_path / "b"), "--resume", *common)
    assert "stagehand ran 2 steps here" in out and "step 3:" in out and "step 1:" not in out
    _assert_same(_adapter(tmp_path / "a" / "step-4" / "pytorch_model.bin"),
                 _adapter(tmp_path / "b" / "step-4" / "pytorch_model.bin"))


def test_trainer_without_offload_is_a_clear_error(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from torch_stagehand.trainers import StagehandTrainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], torch_compile_backend="stagehand")
    with pytest.raises(RuntimeError, match="not offloaded"):
        StagehandTrainer(model=model, args=args)
