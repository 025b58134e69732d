"""Selective precision that acts (issue 10; selective-precision.txt, adaptive-fp8.txt).

- `policy.py`: the decision engine, pure (scores in, a precision map out): thresholds,
  ambiguous default, hysteresis, cooldown, modes, force lists, loss-feedback reverts.
- `grad_stats.py`: per-block gradient statistics accumulated on the device, read once per update.
- `calibration.py`: per-block output error of a candidate precision on real activations, cached on disk.
- `fp8_rules.py`: the measured FP8 policy file (which layer shapes run faster in fp8 than bf16).
- `controller.py`: wires them to a Runtime: runs from the optimizer's hooks, applies maps, logs, writes telemetry.
"""
