"""Selective precision that acts: the policy (`policy.py`) scores blocks from gradient statistics (`grad_stats.py`)
and calibration (`calibration.py`), the FP8 policy file (`fp8_rules.py`) says where fp8 is faster, and
`controller.py` runs them on a Runtime from the optimizer's hooks."""
