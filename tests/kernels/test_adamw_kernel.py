"""The fused AdamW kernel of the device update (kernels/adamw.py): every HostAdamW state format.

CPU: the kernel under Triton's interpreter (tests/kernels/adamw_interp.py in a subprocess) against a float64 AdamW
of the same state and against the host step. GPU: the compiled kernel against the host step on the same weight."""

from __future__ import annotations

import pytest
import torch

from _helpers import interpreted

CASES = ["fp32_master_fp32", "fp32_master_int8", "bf16_master_int8", "bf16_master_bf16", "ragged_int8"]


@pytest.fixture(scope="module")
def interp_results():
    return interpreted("kernels/adamw_interp.py")


@pytest.mark.parametrize("name", CASES)
def test_the_fused_step_is_adamw_in_each_state_format(interp_results, name):
    """One step from the same state lands where float64 AdamW does, each value rounded within one of its rounding
    steps (half of one to nearest) and without bias; twelve steps end beside the host step's weights."""
    rec = interp_results[name]
    assert "exception" not in rec, rec["exception"]
    # measured (CPU, triton 3.9 interpreter): master 4.4e-6 relative; a stochastically rounded value within 0.999
    # of its step, the mean signed error |0.0005-0.013| of a step (3000 elements: 0.005 is one standard error);
    # twelve steps 0.017-0.05 of the host's movement apart (both round at random), 3e-9 when nothing is random
    if "master_rel" in rec:
        assert rec["master_rel"] < 2e-5 and rec["weight_units"] <= 0.5 + 1e-6, rec  # to nearest from the master
    else:
        assert rec["weight_units"] < 1 + 1e-6 and abs(rec["weight_bias"]) < 0.05, rec
    if name.endswith("fp32"):
        assert rec["m_rel"] < 1e-5 and rec["v_rel"] < 1e-5 and rec["against_host"] < 1e-6, rec
        return
    assert rec["m_units"] < 1 + 1e-6 and abs(rec["m_bias"]) < 0.05, rec
    if name.endswith("bf16"):
        assert rec["v_units"] < 1 + 1e-6 and abs(rec["v_bias"]) < 0.05, rec
    else:
        assert rec["root_units"] < 1 + 1e-6 and abs(rec["root_bias"]) < 0.05, rec
        assert rec["scale_rel"] < 1e-5 and rec["nonzero_kept"], rec
    assert rec["against_host"] < 0.1, rec


def test_the_fused_step_rejects_a_state_it_cannot_step():
    from torch_stagehand.kernels.adamw import fused_adamw_

    w = torch.zeros(256, dtype=torch.bfloat16)
    bad = {"exp_avg": torch.zeros(256, dtype=torch.int8), "exp_avg_sq": torch.zeros(256, dtype=torch.int8)}
    with pytest.raises(ValueError, match="not a HostAdamW state format"):
        fused_adamw_(w, w, bad, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 0)
    short = {"exp_avg": torch.zeros(255), "exp_avg_sq": torch.zeros(256)}
    with pytest.raises(ValueError, match="exp_avg has 255 elements"):
        fused_adamw_(w, w, short, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 0)
    scales = {"exp_avg": torch.zeros(256, dtype=torch.int8), "exp_avg_sq": torch.zeros(256, dtype=torch.uint8),
              "exp_avg_scale": torch.zeros(1), "exp_avg_sq_scale": torch.zeros(2)}
    with pytest.raises(ValueError, match="need 2 scales"):
        fused_adamw_(w, w, scales, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("master,states", [("fp32", "fp32"), ("fp32", "int8"), ("bf16", "int8"), ("bf16", "bf16")])
def test_the_compiled_fused_step_follows_the_host_step(master, states):
    """On the GPU, 1M elements, 10 steps: the kernel's weight ends within 5% of the host's movement from it (the
    two round at random; exactly, to fp32, with fp32 states and master)."""
    from torch_stagehand.kernels.adamw import fused_adamw_
    from torch_stagehand.runtime.train.host import Hyper, Scratch, adamw_step, new_state

    n = 1 << 20
    w0 = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    host_w, dev_w = w0.clone(), w0.cuda()
    host_st = new_state(host_w, master, states)
    dev_st = {k: v.cuda() for k, v in new_state(w0, master, states).items() if k != "step"}
    hyper, scratch, gen = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01), tuple(Scratch() for _ in range(4)), torch.Generator()
    for step in range(1, 11):
        g = (torch.randn(n, generator=torch.Generator().manual_seed(step)) * 1e-2).bfloat16()
        adamw_step([host_w], [g], [host_st], hyper, master, scratch, gen)
        fused_adamw_(dev_w, g.cuda(), dev_st, 1e-3, 0.9, 0.999, 1e-8, 0.01, step, seed=step)
    moved = (host_w.double() - w0.double()).abs().mean()
    apart = (dev_w.cpu().double() - host_w.double()).abs().mean() / moved
    assert apart < (1e-3 if states == "fp32" else 0.05), apart
