"""The selective-precision decision engine (pure): every field of the seed's config acts.

Scores are driven directly: with no calibration error the sensitivity is the gradient
score, min(rel_magnitude / grad_sensitivity_threshold, 1), so rel = score * threshold.
"""

from __future__ import annotations

import pytest
import torch

from torch_stagehand.config import Config, ConfigError
from torch_stagehand.runtime.config import PrecisionConfig
from torch_stagehand.runtime.selective.grad_stats import BlockGradStats
from torch_stagehand.runtime.selective.policy import SelectivePolicy


def cfg(**kw) -> PrecisionConfig:
    c = PrecisionConfig(**kw)
    c.validate()
    return c


def rels(c: PrecisionConfig, scores: list[float]) -> list[float]:
    return [s * c.grad_sensitivity_threshold for s in scores]


def decide(c, scores, current=None, step=10, policy=None, errors=None):
    policy = policy or SelectivePolicy(c, len(scores))
    current = current or {b: "bf16" for b in range(len(scores))}
    new, changes = policy.update(step, current, rels(c, scores), errors)
    return new, changes, policy


def test_first_decision_uses_both_thresholds_and_the_ambiguous_default():
    c = cfg(mode="dynamic")
    new, changes, _ = decide(c, [0.1, 0.45, 0.7])
    assert new == {0: "int8", 1: "bf16", 2: "bf16"} and [ch.block for ch in changes] == [0]


@pytest.mark.parametrize("default,expected", [("bf16", "bf16"), ("int8", "int8")])
def test_ambiguous_default(default, expected):
    new, _, _ = decide(cfg(mode="dynamic", ambiguous_default=default), [0.45])
    assert new[0] == expected


@pytest.mark.parametrize("start", ["int8", "bf16"])
@pytest.mark.parametrize("default", ["int8", "bf16"])
def test_a_starting_map_the_user_gave_is_kept_in_the_ambiguous_zone(start, default):
    """The seed: "an ambiguous zone where blocks keep their current assignment". A map the user
    gave (precision= with a mode set) is that assignment; only "auto" leaves it to ambiguous_default.
    Clear scores still move a block either way."""
    c = cfg(mode="dynamic", ambiguous_default=default)
    policy = SelectivePolicy(c, 3, start_given=True)
    new, changes, _ = decide(c, [0.45, 0.1, 0.7], current={0: start, 1: start, 2: start}, policy=policy)
    assert new == {0: start, 1: "int8", 2: "bf16"}
    assert all(ch.block != 0 for ch in changes)


@pytest.mark.parametrize("threshold,expected", [(0.3, "int8"), (0.2, "bf16")])
def test_int8_threshold(threshold, expected):
    new, _, _ = decide(cfg(mode="dynamic", int8_threshold=threshold), [0.25])
    assert new[0] == expected


@pytest.mark.parametrize("threshold,expected", [(0.6, "int8"), (0.45, "bf16")])
def test_bf16_threshold_brings_a_low_block_back(threshold, expected):
    c = cfg(mode="dynamic", bf16_threshold=threshold, min_steps_between_switches=0)
    _, _, policy = decide(c, [0.1])  # decided: int8
    new, _, _ = decide(c, [0.5], current={0: "int8"}, step=20, policy=policy)
    assert new[0] == expected


@pytest.mark.parametrize("margin,expected", [(0.1, "bf16"), (0.0, "int8")])
def test_hysteresis_margin_keeps_a_bf16_block_until_well_below_the_int8_threshold(margin, expected):
    c = cfg(mode="dynamic", hysteresis_margin=margin, min_steps_between_switches=0)
    _, _, policy = decide(c, [0.5])  # decided: bf16 (ambiguous)
    new, _, _ = decide(c, [0.25], step=20, policy=policy)
    assert new[0] == expected


@pytest.mark.parametrize("cooldown,expected", [(20, "int8"), (5, "bf16")])
def test_min_steps_between_switches(cooldown, expected):
    c = cfg(mode="dynamic", min_steps_between_switches=cooldown)
    _, _, policy = decide(c, [0.1], step=10)  # switched to int8 at step 10
    new, _, _ = decide(c, [0.9], current={0: "int8"}, step=20, policy=policy)  # 10 steps later
    assert new[0] == expected


@pytest.mark.parametrize("threshold,score", [(2.0, 0.5), (1.0, 1.0), (4.0, 0.25)])
def test_grad_sensitivity_threshold(threshold, score):
    policy = SelectivePolicy(cfg(grad_sensitivity_threshold=threshold), 1)
    assert policy.sensitivity(1.0, None) == pytest.approx(score)


@pytest.mark.parametrize("threshold,score", [(0.05, 0.7 * 0.5 + 0.3 * 1.0), (0.1, 0.7 * 0.5 + 0.3 * 0.5)])
def test_quant_error_threshold(threshold, score):
    policy = SelectivePolicy(cfg(quant_error_threshold=threshold), 1)
    assert policy.sensitivity(1.0, 0.05) == pytest.approx(score)


@pytest.mark.parametrize("gw,ew", [(0.7, 0.3), (0.2, 0.8), (1.0, 0.0)])
def test_grad_and_error_weights(gw, ew):
    policy = SelectivePolicy(cfg(grad_weight=gw, error_weight=ew), 1)
    # grad score 0.25 (rel 0.5 / 2.0), error score 1.0 (0.08 > 0.05)
    assert policy.sensitivity(0.5, 0.08) == pytest.approx(min(1.0, gw * 0.25 + ew * 1.0))


def test_without_calibration_the_gradient_score_alone_decides():
    policy = SelectivePolicy(cfg(grad_weight=0.2), 1)
    assert policy.sensitivity(1.0, None) == pytest.approx(0.5)


@pytest.mark.parametrize("warmup,due", [(10, True), (20, False), (0, True)])
def test_warmup_steps(warmup, due):
    assert SelectivePolicy(cfg(mode="dynamic", warmup_steps=warmup), 2).due(10) is due


@pytest.mark.parametrize("interval,due", [(5, True), (10, False), (3, True)])
def test_update_interval_steps(interval, due):
    assert SelectivePolicy(cfg(mode="dynamic", warmup_steps=0, update_interval_steps=interval), 2).due(15) is due


def test_mode_off_is_all_bf16_static_keeps_the_start_and_only_dynamic_updates():
    start = {0: "int8", 1: "int8", 2: "bf16"}
    off = SelectivePolicy(cfg(mode="off"), 3)
    static = SelectivePolicy(cfg(mode="static"), 3)
    dynamic = SelectivePolicy(cfg(mode="dynamic"), 3)
    assert off.initial_map(start) == {0: "bf16", 1: "bf16", 2: "bf16"}
    assert static.initial_map(start) == start == dynamic.initial_map(start)
    scores = rels(cfg(), [0.9, 0.9, 0.0])
    assert not off.due(10) and not static.due(10) and dynamic.due(10)
    assert static.update(10, start, scores)[0] == start
    assert dynamic.update(10, start, scores)[0] == {0: "bf16", 1: "bf16", 2: "int8"}


@pytest.mark.parametrize("mode", ["off", "static", "dynamic"])
def test_force_lists_win_in_every_mode(mode):
    c = cfg(mode=mode, force_bf16_blocks=[0], force_int8_blocks=[1], min_steps_between_switches=0)
    policy = SelectivePolicy(c, 3)
    start = {0: "int8", 1: "bf16", 2: "bf16"}
    initial = policy.initial_map(start)
    assert initial[0] == "bf16" and initial[1] == "int8"
    # Scores that would send block 0 down and block 1 up: the force lists still win.
    for step in (10, 20, 30):
        new, _ = policy.update(step, initial, rels(c, [0.0, 1.0, 0.5]))
        assert new[0] == "bf16" and new[1] == "int8"


def test_a_force_list_naming_a_missing_block_is_refused():
    with pytest.raises(ValueError, match="force_.*block 7 does not exist"):
        SelectivePolicy(cfg(force_int8_blocks=[7]), 4)


def _switches(c: PrecisionConfig, scores: list[float]) -> int:
    policy = SelectivePolicy(c, 1)
    current, switches = {0: "bf16"}, 0
    for i, score in enumerate(scores):
        step = (i + 1) * c.update_interval_steps
        current, changes = policy.update(step, current, rels(c, [score]))
        switches += len(changes)
    return switches


def test_hysteresis_and_cooldown_prevent_flicker_on_a_noisy_score():
    # A score wandering across the int8 threshold (0.3) and into the ambiguous zone.
    scores = [0.25, 0.35, 0.22, 0.55, 0.24, 0.62, 0.18, 0.58, 0.26, 0.65, 0.21, 0.31] * 2
    seed = cfg(mode="dynamic")
    naive = cfg(mode="dynamic", hysteresis_margin=0.0, min_steps_between_switches=0, bf16_threshold=0.3,
                int8_threshold=0.3)
    assert _switches(naive, scores) >= 12  # flickers nearly every update
    assert _switches(seed, scores) <= 8
    # Cooldown alone: no block switches twice within 20 steps.
    policy, current, last = SelectivePolicy(seed, 1), {0: "bf16"}, None
    for i, score in enumerate(scores):
        step = (i + 1) * 10
        current, changes = policy.update(step, current, rels(seed, [score]))
        for _ in changes:
            assert last is None or step - last >= 20
            last = step


def test_config_fields_of_the_issue_are_validated():
    with pytest.raises(ConfigError, match="selective_precision.loss_spike_ratio"):
        Config.from_dict({"selective_precision": {"loss_spike_ratio": 0}})
    with pytest.raises(ConfigError, match="selective_precision.fp8_tokens"):
        Config.from_dict({"selective_precision": {"fp8_policy_file": "x.json"}})
    assert Config().selective_precision.mode is None  # not set: a plain precision stays as given


# ---- gradient statistics ----------------------------------------------------------------------


def _params(values: list[list[float]]) -> list[list[torch.Tensor]]:
    out = []
    for vals in values:
        p = torch.zeros(len(vals), requires_grad=True)
        p.grad = torch.tensor(vals)
        out.append([p])
    return out


def test_grad_stats_l2_max_variance_and_relative_magnitude():
    params = _params([[3.0, 4.0], [0.0, 1.0]])
    stats = BlockGradStats(params, window=5, device=torch.device("cpu"))
    stats.collect()
    w = stats.read()
    assert w.l2 == pytest.approx([5.0, 1.0]) and w.max_abs == pytest.approx([4.0, 1.0])
    assert w.variance == pytest.approx([0.25, 0.25])
    assert w.rel_magnitude == pytest.approx([5 / 3, 1 / 3])


@pytest.mark.parametrize("window,rel0", [(1, 1.0), (5, (2 + 4 * 1) / 5 / ((2 + 4 * 1) / 5 + 1) * 2)])
def test_history_window_averages_the_last_steps(window, rel0):
    params = _params([[1.0], [1.0]])
    stats = BlockGradStats(params, window=window, device=torch.device("cpu"))
    for i in range(5):
        params[0][0].grad = torch.tensor([2.0 if i == 0 else 1.0])
        stats.collect()
    assert stats.read().rel_magnitude[0] == pytest.approx(rel0)


_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def test_collecting_statistics_never_reads_the_device_only_the_update_does(monkeypatch):
    """The per-step path queues work only; the host reads the ring once per update."""
    params = _params([[1.0, -2.0], [0.5, 0.5], [3.0, 0.0]])
    stats = BlockGradStats(params, window=5, device=torch.device("cpu"))
    stats.collect()  # builds the cached index / counts
    calls = []
    for name in _HOST_READS:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (calls.append(_n), _o(self, *a, **k))[1])
    for _ in range(25):
        stats.collect()
    assert calls == []
    stats.read()
    assert calls.count("cpu") == 1 and stats.host_reads == 1


def test_a_block_that_can_stream_one_precision_only_is_pinned_like_a_force_list():
    c = cfg(mode="dynamic", force_bf16_blocks=[1])
    policy = SelectivePolicy(c, 2, pinned={0: "int8"})
    assert policy.initial_map({0: "int8", 1: "bf16"}) == {0: "int8", 1: "bf16"}
    new, changes = policy.update(10, {0: "int8", 1: "bf16"}, rels(c, [1.0, 0.0]))
    assert new == {0: "int8", 1: "bf16"} and changes == []
