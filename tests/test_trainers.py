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


def _trainer_run(tmp_path, fail_backward_of_block: int | None):
    """Three StagehandTrainer steps of a tiny random Llama with LoRA; the adapter weights after them."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments, set_seed

    import torch_stagehand as stagehand
    from torch_stagehand.trainers import StagehandTrainer

    set_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    rt = stagehand.offload(model, device="cpu", verbose=False)
    torch._dynamo.reset()
    ids = torch.randint(0, 96, (12, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    if fail_backward_of_block is not None:
        real, calls = rt.op_wait, {"n": 0}

        def op_wait(b, precision_code, nbytes, backward):
            slot = real(b, precision_code, nbytes, backward)
            if backward and b == fail_backward_of_block:
                calls["n"] += 1
                if calls["n"] == 2:  # the second step's backward
                    raise torch.OutOfMemoryError("CUDA out of memory (injected in a backward)")
            return slot

        rt.op_wait = op_wait
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to=[], use_cpu=True, save_strategy="no", torch_compile=True,
                             torch_compile_backend="stagehand", logging_steps=1)
    trainer = StagehandTrainer(model=model, args=args, train_dataset=data, stagehand_options={"inner": "eager"})
    trainer.train()
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}, trainer


def test_the_trainer_runs_a_step_that_ran_out_of_memory_again_with_the_same_numbers(tmp_path):
    """StagehandTrainer.training_step goes through rt.run_step: a backward that runs out of memory in the
    second step is run again on the gradients from before it; the adapter ends where an undisturbed run's does."""
    from torch_stagehand import OutOfMemoryWarning

    reference, _ = _trainer_run(tmp_path / "a", None)
    with pytest.warns(OutOfMemoryWarning, match="did not finish"):
        disturbed, trainer = _trainer_run(tmp_path / "b", fail_backward_of_block=1)
    assert trainer.state.global_step == 3
    _assert_same(reference, disturbed)
