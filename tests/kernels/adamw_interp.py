"""The GPU's fused AdamW kernel (kernels/adamw.py) under the interpreter against the host path (CPU; one JSON line
per case).

Not collected by pytest: tests/kernels/test_adamw_kernel.py runs it in a subprocess with TRITON_INTERPRET=1 (set before
Triton is imported). Each case steps the same weight from the same gradients with the kernel and with HostAdamW's
host step (`adamw_step`), in one of its state formats, and reports:
- one step from the same state: the kernel's values against a float64 AdamW of the decoded state (the master's
  relative error; how far each rounded value lies from its exact value, in units of its rounding step; the mean
  signed error in those units, which is ~0 when the rounding is unbiased);
- `steps` steps each way: how far the kernel's weight ends from the host's, relative to how far the host's moved.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

# name -> (elements, master, states)
CASES = {
    "fp32_master_fp32": (3000, "fp32", "fp32"),
    "fp32_master_int8": (3000, "fp32", "int8"),
    "bf16_master_int8": (3000, "bf16", "int8"),
    "bf16_master_bf16": (2100, "bf16", "bf16"),
    "ragged_int8": (1029, "bf16", "int8"),  # not a multiple of a scale block nor of a program's tile
}
LR, BETAS, EPS, DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
STEPS = 12


def _grad(n: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    grad = torch.randn(n, generator=g) * 1e-2
    grad[256:384] = 0.0  # a whole scale block of zero gradients: its moments decay, a zero block's scale is 0
    return grad.bfloat16()


def _host_state(w: torch.Tensor, master: str, states: str):
    from torch_stagehand.runtime.train.host import new_state

    return new_state(w, master, states)


def _decoded(st: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from torch_stagehand.kernels.adamw import QBLOCK

    m, v = st["exp_avg"], st["exp_avg_sq"]
    if m.dtype != torch.int8:
        return m.double(), v.double()
    n = m.numel()
    pad = -(-n // QBLOCK) * QBLOCK - n
    dm = torch.nn.functional.pad(m.double(), (0, pad)).view(-1, QBLOCK) * st["exp_avg_scale"].double()[:, None]
    dv = torch.nn.functional.pad(v.double(), (0, pad)).view(-1, QBLOCK) * st["exp_avg_sq_scale"].double()[:, None]
    return dm.view(-1)[:n], dv.view(-1)[:n].square()


def _exact(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int):
    """float64 AdamW (torch's decoupled form) of one step."""
    b1, b2 = BETAS
    g = g.double()
    p = p - LR * DECAY * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - LR / (1 - b1 ** step) * m / (v.sqrt() / math.sqrt(1 - b2 ** step) + EPS)
    return p, m, v


def _units(got: torch.Tensor, exact: torch.Tensor, unit: torch.Tensor) -> tuple[float, float]:
    """(max |got - exact| / unit, mean (got - exact) / unit) over elements with a nonzero unit."""
    keep = unit > 0
    err = (got.double() - exact)[keep] / unit[keep]
    return float(err.abs().max()), float(err.mean())


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values around |x|."""
    e = torch.frexp(x.double().abs().clamp_min(1e-30))[1]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 8)


def run_case(name: str) -> dict:
    from torch_stagehand.kernels.adamw import QBLOCK, fused_adamw_
    from torch_stagehand.runtime.train.host import Hyper, Scratch, adamw_step

    n, master, states = CASES[name]
    w0 = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).bfloat16()
    hyper = Hyper(LR, BETAS[0], BETAS[1], EPS, DECAY)
    host_w, dev_w = w0.clone(), w0.clone()
    host_st, dev_st = _host_state(host_w, master, states), _host_state(dev_w, master, states)
    scratch = tuple(Scratch() for _ in range(4))
    gen = torch.Generator().manual_seed(7)
    rec = dict(name=name)
    for step in range(1, STEPS + 1):
        g = _grad(n, step)
        adamw_step([host_w], [g], [host_st], hyper, master, scratch, gen)
        if step == STEPS:  # the last step of the kernel's run: checked element by element against float64
            p_before = dev_st["master"].double() if "master" in dev_st else dev_w.double()
            m_before, v_before = _decoded(dev_st)
            p_ex, m_ex, v_ex = _exact(p_before, g, m_before, v_before, step)
        tensors = {k: t for k, t in dev_st.items() if k != "step"}
        fused_adamw_(dev_w, g, tensors, LR, BETAS[0], BETAS[1], EPS, DECAY, step, seed=step)
        dev_st["step"].add_(1)
    m_got, v_got = _decoded(dev_st)
    if "master" in dev_st:
        rec["master_rel"] = float(((dev_st["master"].double() - p_ex).abs() / p_ex.abs().clamp_min(1e-12)).max())
        # to nearest from the kernel's own master: at most half a spacing away from it
        rec["weight_units"], _ = _units(dev_w, dev_st["master"].double(), _bf16_ulp(dev_st["master"]))
    else:
        rec["weight_units"], rec["weight_bias"] = _units(dev_w, p_ex, _bf16_ulp(p_ex))
    if states == "int8":
        blocks = -(-n // QBLOCK)
        pad = blocks * QBLOCK - n
        m_unit = dev_st["exp_avg_scale"].double().repeat_interleave(QBLOCK)[:n]
        root_unit = dev_st["exp_avg_sq_scale"].double().repeat_interleave(QBLOCK)[:n]
        rec["m_units"], rec["m_bias"] = _units(m_got, m_ex, m_unit)
        rec["root_units"], rec["root_bias"] = _units(v_got.sqrt(), v_ex.sqrt(), root_unit)
        ex_scale = torch.nn.functional.pad(m_ex.abs(), (0, pad)).view(-1, QBLOCK).amax(1) / 127
        rec["scale_rel"] = float(((dev_st["exp_avg_scale"].double() - ex_scale).abs()
                                  / ex_scale.clamp_min(1e-30)).max())
        rec["nonzero_kept"] = bool(((v_ex > 0) <= (dev_st["exp_avg_sq"] > 0)).all())
    elif states == "bf16":
        rec["m_units"], rec["m_bias"] = _units(m_got, m_ex, _bf16_ulp(m_ex))
        rec["v_units"], rec["v_bias"] = _units(v_got, v_ex, _bf16_ulp(v_ex))
    else:
        # against the moment's largest value: an element near cancellation has no relative error to speak of
        rec["m_rel"] = float((m_got - m_ex).abs().max() / m_ex.abs().max())
        rec["v_rel"] = float((v_got - v_ex).abs().max() / v_ex.abs().max())
    moved = (host_w.double() - w0.double()).abs().mean()
    rec["against_host"] = float((dev_w.double() - host_w.double()).abs().mean() / moved)
    rec["elements"] = n
    return rec


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _helpers
    from _helpers import report_cases

    report_cases("adamw_interp.py", run_case, sys.argv[1:] or list(CASES))
