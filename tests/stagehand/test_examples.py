"""The examples run as written, each on a tiny checkpoint this test saves first (random init from a
small config), and the README's quick start is exactly examples/quickstart.py. An example given a
folder that is missing, or that holds no checkpoint, says so in one line naming it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import ROOT

EXAMPLES = ROOT / "examples"


def _run(name: str, *args: str, timeout: int = 240, gpu: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore::FutureWarning")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CI's CPU run, also on a machine with a GPU
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def run_example(name: str, *args: str, timeout: int = 240, gpu: bool = False) -> str:
    proc = _run(name, *args, timeout=timeout, gpu=gpu)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


def save_tiny_llama(folder: Path) -> None:
    """A Llama checkpoint folder as from_pretrained reads it, written by the example users run."""
    run_example("make_tiny_checkpoint.py", "llama", str(folder))


def save_tiny_flux(folder: Path) -> None:
    run_example("make_tiny_checkpoint.py", "flux", str(folder))


def adapter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def test_readme_quick_start_is_the_example():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == (EXAMPLES / "quickstart.py").read_text()


def test_quickstart_runs_as_written():
    out = run_example("quickstart.py")
    losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it trains
    assert "stagehand offload: 4 blocks" in out and "int8 2 blocks" in out  # offload said what it did
    assert "stagehand: first step took" in out
    assert "backward" in out and "prefetch" in out  # explain's schedule table


def test_causal_lm_recipe_trains_saves_and_reloads(tmp_path):
    save_tiny_llama(tmp_path / "model")
    out = run_example("lora_causal_lm.py", str(tmp_path / "model"), "--steps", "4", "--seq", "32",
                      "--out", str(tmp_path / "lora"), "--precision", "0:int8")
    assert "reloaded with PeftModel.from_pretrained" in out
    tensors = adapter_tensors(tmp_path / "lora")
    lora_b = [t for k, t in tensors.items() if "lora_B" in k]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # trained: peft initialises B to zero


def test_causal_lm_recipe_trains_a_mixture_of_experts_checkpoint(tmp_path):
    run_example("make_tiny_checkpoint.py", "qwen3_moe", str(tmp_path / "moe"))
    out = run_example("lora_causal_lm.py", str(tmp_path / "moe"), "--steps", "3", "--seq", "32",
                      "--out", str(tmp_path / "lora"), "--precision", "int8")
    assert "8 streamed Linears and 4 expert stacks" in out  # from_pretrained fused the saved experts: they stream
    assert "reloaded with PeftModel.from_pretrained" in out


def test_flux_recipe_trains_saves_and_reloads_into_diffusers(tmp_path):
    save_tiny_flux(tmp_path / "flux")
    out = run_example("lora_flux.py", str(tmp_path / "flux"), "--steps", "3", "--out", str(tmp_path / "lora"))
    assert "reloaded with diffusers' load_lora_adapter" in out
    keys = adapter_tensors(tmp_path / "lora")
    assert any(k.startswith("base_model.model.single_transformer_blocks.") for k in keys)  # both block lists
    assert any(k.startswith("base_model.model.transformer_blocks.") for k in keys)
    assert all(t.abs().sum() > 0 for k, t in keys.items() if "lora_B" in k)


def test_hf_trainer_reloads_its_adapter_into_the_plain_model(tmp_path):
    save_tiny_llama(tmp_path / "model")
    out = run_example("hf_trainer.py", str(tmp_path / "model"), "--steps", "2", "--save-steps", "2", "--seq", "32",
                      "--out", str(tmp_path / "run"))
    assert f"saved the adapter to {tmp_path / 'run' / 'adapter'}" in out
    assert "reloaded with PeftModel.from_pretrained: max |logits difference|" in out  # assert_close passed after it
    lora_b = [t for k, t in adapter_tensors(tmp_path / "run" / "adapter").items() if "lora_B" in k]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # trained, so the comparison can tell


@pytest.mark.parametrize("name", ["hf_trainer.py", "accelerate_loop.py"])
def test_trainer_recipes_run_on_two_ranks_under_torchrun_with_one_host_store(name, tmp_path):
    """`torchrun --nproc_per_node=2` (gloo on the CPU): the Trainer and accelerate wrap the offloaded model in DDP,
    the two ranks share one host store, and both train to the end."""
    save_tiny_llama(tmp_path / "model")
    port = str(29500 + os.getpid() % 400)
    env = dict(os.environ, PYTHONWARNINGS="ignore::FutureWarning", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", port,
                           str(EXAMPLES / name), str(tmp_path / "model"), "--steps", "2", "--seq", "32",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=400, env=env,
                          cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("shared by the 2 ranks of this node") == 2  # each rank's offload report
    assert out.count("stagehand ran 2 steps here") == 2


FOLDER_EXAMPLES = ["lora_causal_lm.py", "hf_trainer.py", "accelerate_loop.py", "lora_flux.py"]


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("name", FOLDER_EXAMPLES)
def test_a_missing_folder_is_named_in_one_line_not_looked_up_on_the_hub(name, tmp_path):
    missing = tmp_path / "no-such-model"
    line = _one_line_error(_run(name, str(missing)))
    assert f"{str(missing)!r} does not exist" in line and "checkpoint folder" in line
    assert "huggingface" not in line.lower() and "hub" not in line.lower()


def test_a_folder_that_is_no_checkpoint_says_what_it_lacks(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    line = _one_line_error(_run("lora_causal_lm.py", str(tmp_path)))
    assert f"{str(tmp_path)!r} does not look like a causal LM checkpoint" in line
    assert "no config.json" in line and "no weights" in line and "no tokenizer" in line
    line = _one_line_error(_run("lora_flux.py", str(tmp_path / "notes.txt")))
    assert "is a file, not a folder" in line


def test_the_examples_output_folders_are_ignored_by_git():
    ignored = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()]
    for name in FOLDER_EXAMPLES:
        default = re.search(r'add_argument\("--out", default="([^"]+)"', (EXAMPLES / name).read_text()).group(1)
        assert f"{default}/" in ignored, f"{name}: --out {default} is not in .gitignore"


@pytest.mark.gpu
def test_examples_on_the_gpu(tmp_path):
    """The same examples on CUDA (bf16, inner compiler Inductor, pinned host store)."""
    out = run_example("quickstart.py", gpu=True, timeout=600)
    assert "device cuda" in out and "bf16 pinned" in out  # the report names each host copy and where it is
    save_tiny_llama(tmp_path / "llama")
    out = run_example("lora_causal_lm.py", str(tmp_path / "llama"), "--steps", "4", "--seq", "32",
                      "--out", str(tmp_path / "lora"), "--precision", "0:int8", gpu=True, timeout=600)
    assert "reloaded with PeftModel.from_pretrained" in out
    save_tiny_flux(tmp_path / "flux")
    out = run_example("lora_flux.py", str(tmp_path / "flux"), "--steps", "3", "--out", str(tmp_path / "flora"),
                      "--checkpointing", gpu=True, timeout=600)
    assert "reloaded with diffusers' load_lora_adapter" in out
