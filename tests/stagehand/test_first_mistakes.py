"""The mistakes a user makes in a first hour (issue 58, part 4): each is one line naming the thing (the layer, the
tensor, the file, the number) or it just works and says what it did. Real small HF models, real safetensors files
written in tmp_path, on the CPU; the real GPU cases are marked `gpu`.

Handled and asserted elsewhere (not repeated here): offload twice, a typo in `blocks`, an unknown precision
(tests/runtime/test_runtime.py::test_bad_input_errors_name_the_problem); a budget without a unit
(tests/runtime/conductor/test_budget_units.py) or below the smallest plan
(tests/runtime/conductor/test_budget_plan.py::test_budgets_from_the_config_and_their_errors,
tests/stagehand/test_plan_folder.py::test_a_budget_below_the_smallest_plan_names_the_number); deepcopy of an
offloaded model (tests/runtime/test_runtime.py::test_deepcopy_of_an_offloaded_model_is_refused); peft after a CPU
offload (tests/runtime/test_offload_transaction.py::test_peft_added_after_a_cpu_offload_computes_what_peft_before_
offload_computes); a transformers pipeline folder to `stagehand plan` (tests/stagehand/test_plan_folder.py::
test_bad_folders_are_one_line_errors_naming_the_file); a slab of other weights of the same shapes
(tests/runtime/slab/test_slab_identity.py::test_slab_of_other_weights_is_refused_naming_the_first_layer).
"""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch
from accelerate import init_empty_weights

import torch_stagehand as stagehand
from torch_stagehand.api import moved_to_host_line, weights_off_host
from torch_stagehand.app.cli import main
from torch_stagehand.app.plan import plan_folder, render
from torch_stagehand.runtime.blocks import find_blocks, streamed_layers
from torch_stagehand.runtime.host import budget as host_budget
from torch_stagehand.runtime.host.budget import MachineMemory
from torch_stagehand.runtime.host.plan import HostMemoryError
from torch_stagehand.runtime.host.weights_file import CheckpointError
from torch_stagehand.runtime.slab import SlabModelMismatchError, build_slab_from_module
from torch_stagehand.runtime.streamed import is_streamed

from _helpers import assert_exact, int8_reference, page_locked, rel_err, toy


def _one_line(message: str) -> str:
    assert "\n" not in message.strip(), message
    return message


def _qwen(intermediate: int = 64, layers: int = 3):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                       architectures=["Qwen2ForCausalLM"])


# ---- CUDA missing; a compiled model ---------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
def test_device_cuda_without_cuda_is_one_line_and_touches_nothing():
    model, _ = toy(n=2)
    with pytest.raises(RuntimeError) as e:
        stagehand.offload(model, device="cuda", verbose=False)
    assert _one_line(str(e.value)) == "offload: device='cuda' but CUDA is not available"
    assert not any(is_streamed(m) for m in model.modules())


def test_a_model_compiled_before_offload_is_offloaded_and_compiles_with_the_backend():
    model, x = toy(n=3)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model)  # the habit: compile first (never called: nothing compiled yet)
    rt = stagehand.offload(compiled, device="cpu", precision={1: "int8"}, verbose=False)
    assert rt.blocks == ["_orig_mod.blocks.0", "_orig_mod.blocks.1", "_orig_mod.blocks.2"]
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(compiled, backend="stagehand", options={"inner": "eager"})(x)
        # the int8 block computes the dequantized weights: measured 1.2e-7 (CPU, torch 2.13, 3 seeds)
        assert rel_err(out, int8_reference(reference, {1: "int8"})(x)) < 5e-7
    assert rt.stats()["h2d_bytes"] > 0
    rt.restore()
    torch._dynamo.reset()
    with torch.no_grad():
        assert_exact(model(x), reference(x))


# ---- (a) a model already on the GPU ---------------------------------------------------------------------------


def test_streamed_weights_on_an_accelerator_are_found_and_the_move_is_said():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, _ = toy(n=3)
    layers = streamed_layers(model, find_blocks(model))
    assert weights_off_host(layers) is None  # in host memory: nothing to move
    assert weights_off_host(streamed_layers(model.to("meta"), find_blocks(model))) is None  # a checkpoint's
    with FakeTensorMode():  # a CUDA tensor without a GPU: only its device is read
        on_gpu = torch.empty(64, 32, device="cuda")
    model.blocks[1].up.weight = torch.nn.Parameter(on_gpu, requires_grad=False)
    model.blocks[2].down.weight = torch.nn.Parameter(on_gpu.t(), requires_grad=False)
    assert weights_off_host(layers) == (2, "blocks.1.up.weight", torch.device("cuda", 0))
    line = _one_line(moved_to_host_line(2, "blocks.1.up.weight", torch.device("cuda", 0), pinned=True))
    assert line.startswith("stagehand offload: 2 streamed weights were on cuda:0 (first blocks.1.up.weight)")
    assert "host memory" in line and "page-locked" in line and "restore() puts them back on cuda:0" in line


@pytest.mark.gpu
def test_a_model_on_the_gpu_streams_from_the_host_and_says_so_once(capsys):
    model, x = toy(n=3)
    reference = copy.deepcopy(model).cuda()
    model.cuda()
    rt = stagehand.offload(model, device="cuda")
    err = capsys.readouterr().err
    moved = [line for line in err.splitlines() if "streamed weights were on cuda" in line]
    assert len(moved) == 1 and "(first blocks.0.up.weight)" in moved[0]
    assert model.blocks[0].up.weight.device.type == "cpu" and page_locked(model.blocks[0].up.weight)
    assert model.embed.weight.is_cuda
    with torch.no_grad():
        assert_exact(model(x.cuda()), reference(x.cuda()))  # bf16 streaming: the same weights, the same ops
    rt.restore()
    assert model.blocks[0].up.weight.is_cuda
    assert torch.equal(model.blocks[0].up.weight, reference.blocks[0].up.weight)


@pytest.mark.gpu
def test_peft_after_a_gpu_offload_then_to_cuda_computes_what_peft_before_computes():
    peft = pytest.importorskip("peft")
    model, x = toy(n=3)

    def lora(m):
        torch.manual_seed(5)
        return peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["up", "down"], init_lora_weights=False))

    reference = lora(copy.deepcopy(model)).cuda()
    rt = stagehand.offload(model, device="cuda", verbose=False)
    wrapped = lora(model).to("cuda")  # peft puts its adapters beside the base weight (the host): moved back here
    torch._dynamo.reset()
    with torch.no_grad():
        expected = reference(x.cuda())
        assert rel_err(wrapped(x.cuda()), expected) < 1e-6
        out = torch.compile(wrapped, backend="stagehand")(x.cuda())
        assert rel_err(out, expected) < 1e-6
    rt.restore()
    torch._dynamo.reset()


# ---- (b) a diffusers pipeline folder where its transformer/ is meant ------------------------------------------


_FLUX = dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
             pooled_projection_dim=32, in_channels=16, axes_dims_rope=(4, 6, 6))


def _pipeline_folder(tmp_path, transformer_class="FluxTransformer2DModel"):
    """A pipeline folder as diffusers saves one: model_index.json, transformer/ (a tiny Flux), scheduler/."""
    from diffusers import FluxTransformer2DModel

    folder = tmp_path / "FLUX.1-tiny"
    torch.manual_seed(0)
    FluxTransformer2DModel(**_FLUX).save_pretrained(folder / "transformer")
    (folder / "scheduler").mkdir()
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "FluxPipeline", "_diffusers_version": "0.35.0",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": [None, None],
        "transformer": ["diffusers", transformer_class]}))
    return folder


def _flux_inputs():
    g = torch.Generator().manual_seed(3)
    return dict(hidden_states=torch.randn(1, 16, 16, generator=g), encoder_hidden_states=torch.randn(1, 4, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3), return_dict=False)


def test_offload_given_a_pipeline_folder_reads_its_transformer_and_says_so(tmp_path, capsys):
    from diffusers import FluxTransformer2DModel

    folder = _pipeline_folder(tmp_path)
    loaded = FluxTransformer2DModel.from_pretrained(folder / "transformer").eval()
    with init_empty_weights():
        meta = FluxTransformer2DModel(**_FLUX).eval()
    stagehand.offload(meta, device="cpu", precision="bf16", checkpoint=folder)
    said = [line for line in capsys.readouterr().err.splitlines() if "diffusers pipeline folder" in line]
    assert said == [f"stagehand offload: checkpoint {folder} is a diffusers pipeline folder: reading its "
                    f"transformer/ (FluxTransformer2DModel, as model_index.json names it), {folder / 'transformer'}"]
    with torch.no_grad():  # the file's weights: measured 1.1e-7 (CPU, torch 2.13; a streamed Linear's own GEMM)
        assert rel_err(meta(**_flux_inputs())[0], loaded(**_flux_inputs())[0]) < 5e-7


def test_a_pipeline_folder_without_the_models_class_names_the_subfolder_to_pass(tmp_path):
    from diffusers import FluxTransformer2DModel

    folder = _pipeline_folder(tmp_path, transformer_class="SD3Transformer2DModel")  # not the model offloaded
    with init_empty_weights():
        meta = FluxTransformer2DModel(**_FLUX)
    with pytest.raises(CheckpointError) as e:
        stagehand.offload(meta, device="cpu", checkpoint=str(folder), verbose=False)
    assert _one_line(str(e.value)) == (
        f"checkpoint {str(folder)!r}: a diffusers pipeline folder (model_index.json), not one model's: pass the "
        f"subfolder of the model offloaded: {folder / 'transformer'} (SD3Transformer2DModel)")
    assert meta.transformer_blocks[0].ff.net[2].weight.is_meta  # nothing loaded


def test_plan_given_a_unet_pipeline_folder_names_its_unet(tmp_path, capsys):
    folder = tmp_path / "sd-tiny"
    (folder / "unet").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                         "unet": ["diffusers", "UNet2DConditionModel"]}))
    assert main(["plan", str(folder), "--vram-budget", "8GiB"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"{folder}: a diffusers pipeline folder (model_index.json): plan its unet, {folder / 'unet'}" in err


# ---- (c) a checkpoint whose shapes disagree with the model ----------------------------------------------------


def test_a_checkpoint_of_other_shapes_names_the_tensor_the_file_and_both_shapes(tmp_path):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(_qwen(64)).save_pretrained(tmp_path, max_shard_size="40KB")  # shards and an index json
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(shards) > 1
    with init_empty_weights():
        meta = Qwen2ForCausalLM(_qwen(96))
    with pytest.raises(CheckpointError) as e:
        stagehand.offload(meta, device="cpu", checkpoint=tmp_path, verbose=False)
    message = _one_line(str(e.value))
    found = re.fullmatch(r"checkpoint '(.+)': (model\.layers\.0\.mlp\.\w+_proj\.weight) has shape \((\d+), (\d+)\), "
                         r"the model's weight \((\d+), (\d+)\)", message)
    assert found, message
    path, name = found.group(1), found.group(2)
    assert os.path.basename(path) in shards  # the shard that holds it, not the folder
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[name] == os.path.basename(path)
    file_shape, model_shape = tuple(map(int, found.groups()[2:4])), tuple(map(int, found.groups()[4:6]))
    assert tuple(meta.get_parameter(name).shape) == model_shape and 64 in file_shape and 96 in model_shape
    assert meta.model.layers[0].mlp.up_proj.weight.is_meta  # nothing was loaded


# ---- (d) a host too small for the plan ------------------------------------------------------------------------


def test_a_host_too_small_is_one_line_with_the_bytes_needed_and_available(monkeypatch, tmp_path, capsys):
    from transformers import Qwen2ForCausalLM

    small = MachineMemory(total_bytes=2**30, available_bytes=64 * 2**10)  # 64 KiB available
    monkeypatch.setattr(host_budget, "probe_machine", lambda: small)  # the reading offload and plan both make
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_qwen()).to(torch.bfloat16)
    weights = dict(model.named_parameters())
    with pytest.raises(HostMemoryError) as e:
        stagehand.offload(model, device="cpu", precision="int8", keep_full="ram", verbose=False)
    message = _one_line(str(e.value))
    need = re.search(r"it needs ([\d.]+ [KMG]iB) more host memory and 64\.00 KiB can be had", message)
    assert need, message
    assert "MemAvailable 64.00 KiB of 1.00 GiB" in message and "To fit: " in message
    assert all(dict(model.named_parameters())[k] is v for k, v in weights.items())  # nothing moved

    folder = tmp_path / "qwen"
    _qwen().save_pretrained(folder)  # its config alone: `stagehand plan` reads the same machine
    plan = plan_folder(str(folder), "1GiB", precision="int8", train="lora", tokens=16)
    assert plan.host_usable_bytes == 64 * 2**10 and plan.host.ram_bytes > 64 * 2**10
    assert "more than this machine can give now (64.00 KiB): offload here would stop at its host-memory " \
           "preflight" in render(plan)


# ---- (e) a slab built for another model -----------------------------------------------------------------------


def test_a_slab_built_for_a_model_of_other_shapes_names_the_layer_and_both_shapes(tmp_path):
    built_for, _ = toy(n=3, d=64)
    manifest = build_slab_from_module(built_for, tmp_path / "slab", "toy_int8", "toy-v1", include_prefixes=("blocks.",),
                                      progress=False, print_report=False, compare_quantizers=False).manifest_path
    other, x = toy(n=3, d=32)
    with torch.no_grad():
        before = other(x)
    with pytest.raises(SlabModelMismatchError) as e:
        stagehand.offload(other, device="cpu", precision="int8", slab=manifest, verbose=False)
    message = _one_line(str(e.value))
    assert message == f"{manifest}: layer 'blocks.0.down': model has [out, in] = [32, 64], slab has [64, 128]"
    with torch.no_grad():
        assert_exact(other(x), before)  # refused before a weight moved
