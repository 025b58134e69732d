"""Config: the seeds' defaults, both JSON layouts, errors that name the field."""

from __future__ import annotations

import json

import pytest

from torch_stagehand import Config, ConfigError


def test_defaults_are_the_seeds():
    c = Config()
    sp, cd = c.selective_precision, c.conductor
    assert (sp.effective_mode, sp.bf16_threshold, sp.int8_threshold, sp.hysteresis_margin) == ("dynamic", 0.6, 0.3, 0.1)
    assert (sp.grad_weight, sp.error_weight, sp.warmup_steps, sp.min_steps_between_switches) == (0.7, 0.3, 10, 20)
    assert (cd.h2d_slots, cd.d2h_slots, cd.prefetch_window) == (2, 2, 1)
    assert c.slot_count == 2


def test_seed_training_config_layout_loads(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"memory": {"stagehand": {
        "conductor_config": {"enabled": True, "vram_soft_cap_mb": 22000, "vram_hard_cap_mb": 23500, "h2d_slots": 2},
        "selective_precision": {"enabled": True, "mode": "dynamic", "warmup_steps": 10, "bf16_threshold": 0.6},
    }}}))
    c = Config.from_json(str(path))
    assert c.conductor.vram_hard_cap_mb == 23500 and c.selective_precision.mode == "dynamic"
    assert Config.from_json('{"slots": 3, "quantizer": "absmax"}').slot_count == 3


@pytest.mark.parametrize("text, field", [
    ('{"selective_precision": {"bf16_threshold": 1.5}}', "selective_precision.bf16_threshold"),
    ('{"selective_precision": {"mode": "sometimes"}}', "selective_precision.mode"),
    ('{"conductor": {"h2d_slots": 0}}', "conductor.h2d_slots"),
    ('{"conductor": {"vram_soft_cap_mb": 30000, "vram_hard_cap_mb": 20000}}', "conductor.vram_soft_cap_mb"),
    ('{"conductor": {"prefetch_windw": 2}}', "conductor.prefetch_windw"),
    ('{"slots": 1, "conductor": {"prefetch_window": 2}}', "slots"),
    ('{"quantizer": "gptq"}', "quantizer"),
    ('{"selective_precision": {"force_bf16_blocks": [1], "force_int8_blocks": [1]}}', "force_bf16_blocks"),
])
def test_errors_name_the_field(text, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        Config.from_json(text)


def test_shadowed_conductor_knobs_are_honoured_or_named():
    # Config.slots / Config.telemetry_file win; the conductor section's twins fill in when those are unset.
    assert Config.from_json('{"conductor": {"h2d_slots": 3}}').slot_count == 3
    assert Config.from_json('{"slots": 4, "conductor": {"h2d_slots": 4}}').slot_count == 4
    assert Config.from_json('{"conductor": {"prefetch_window": 2}}').slot_count == 3  # h2d_slots at its default
    c = Config.from_json('{"conductor": {"telemetry_file": "c.jsonl"}}')
    assert c.telemetry_path == "c.jsonl" and Config(telemetry_file="t.jsonl").telemetry_path == "t.jsonl"
    assert Config().telemetry_path is None
    for text, field in [('{"slots": 3, "conductor": {"h2d_slots": 4}}', "conductor.h2d_slots"),
                        ('{"conductor": {"h2d_slots": 1}}', "conductor.h2d_slots"),
                        ('{"telemetry_file": "a", "conductor": {"telemetry_file": "b"}}', "conductor.telemetry_file")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            Config.from_json(text)


def test_the_expert_cache_size_is_bytes_a_size_or_auto_and_a_bad_one_is_named():

    for ok in ("auto", 0, "2GiB", 64 * 2**20):
        Config(expert_cache_bytes=ok).validate()
    for bad in (20, "lots", -5):
        with pytest.raises(ConfigError, match="expert_cache_bytes"):
            Config(expert_cache_bytes=bad).validate()
