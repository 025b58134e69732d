"""Built-in targets and file:factory targets."""

from __future__ import annotations

import pytest
import torch

from torch_stagehand.app.presets import DiT, TargetError, call_model, dit, load_target


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-flux"])
def test_hf_presets_build_and_run_plain(name):
    model, inputs = load_target(name)
    with torch.no_grad():
        out = call_model(model, inputs)
    first = out[0] if isinstance(out, tuple) else out.logits
    assert torch.isfinite(first.float()).all() and first.dtype == torch.bfloat16


def test_dit_shape_and_block_bytes():
    model, (x,) = dit(depth=2, hidden=96, heads=4, tokens=8)
    assert len(model.blocks) == 2 and x.shape == (1, 8, 64)
    per_block = sum(p.numel() for n, p in model.blocks[0].named_parameters() if n.endswith("weight") and p.dim() == 2)
    assert per_block == 96 * (3 * 96 + 96 + 4 * 96 + 4 * 96)  # qkv, proj, fc1, fc2
    with torch.no_grad():
        assert model(x).shape == x.shape
    # The performance workload (216 MiB of BF16 per block), counted on its real block.
    with torch.device("meta"):
        big = DiT(depth=1, hidden=3072, heads=24).to(torch.bfloat16)
    weights = [p for n, p in big.blocks[0].named_parameters() if n.endswith("weight") and p.dim() == 2]
    assert sum(p.numel() * p.element_size() for p in weights) == 216 * 2**20


def test_file_factory_target_and_errors(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "import torch\n"
        "def build():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
        "    return m, (torch.ones(1, 4),)\n"
        "def wrong():\n"
        "    return 3\n"
    )
    model, inputs = load_target(f"{path}:build")
    assert isinstance(model, torch.nn.Module) and inputs[0].shape == (1, 4)
    with pytest.raises(TargetError, match="no function 'nope'"):
        load_target(f"{path}:nope")
    with pytest.raises(TargetError, match=r"must return \(model, example_inputs\)"):
        load_target(f"{path}:wrong")
    with pytest.raises(TargetError, match="no file"):
        load_target(f"{tmp_path}/missing.py:build")
    with pytest.raises(TargetError, match="unknown target 'tiny-bert'"):
        load_target("tiny-bert")
