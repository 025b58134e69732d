"""The autotuner's on-disk cache: keyed by device, builds and kernel source; round trip; bad files."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from torch_stagehand.kernels.tuning import autotune as tune  # noqa: E402

from torch_stagehand.kernels.tuning import cache as tune_cache


def test_configs_round_trip_through_the_file(tmp_path):
    path = tmp_path / "w8a16.json"
    key = ("fwd", torch.device("cuda", 1), 4096, 3072, 12288, torch.bfloat16)
    config = tune.LaunchConfig(128, 256, 64, 1, 8, 3, 1)
    tune_cache.TuneCache(str(path)).put(key, config)
    assert json.loads(path.read_text()) == {"fwd|4096|3072|12288|bfloat16": config.__dict__}
    # another process (a fresh object), another device index of the same kind: the same entry
    other = ("fwd", torch.device("cuda", 0), 4096, 3072, 12288, torch.bfloat16)
    assert tune_cache.TuneCache(str(path)).get(other, tune.LaunchConfig) == config
    assert tune_cache.TuneCache(str(path)).get(("bwd",) + other[1:], tune.LaunchConfig) is None


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"fwd|16|8|8|bfloat16": {"no_such_field": 1}}'])
def test_a_bad_file_means_tuning_again(tmp_path, content):
    path = tmp_path / "w8a16.json"
    path.write_text(content)
    cache = tune_cache.TuneCache(str(path))
    key = ("fwd", torch.device("cuda"), 16, 8, 8, torch.bfloat16)
    assert cache.get(key, tune.LaunchConfig) is None
    cache.put(key, tune.DEQUANT)  # and the rewrite repairs it
    assert tune_cache.TuneCache(str(path)).get(key, tune.LaunchConfig) == tune.DEQUANT


def test_the_fingerprint_changes_with_device_and_kernel_source(monkeypatch):
    base = tune_cache.fingerprint("NVIDIA H100 80GB HBM3", "9.0")
    assert tune_cache.fingerprint("NVIDIA H200", "9.0") != base
    assert tune_cache.fingerprint("NVIDIA H100 80GB HBM3", "8.0") != base
    monkeypatch.setattr(tune_cache, "source_fingerprint", lambda: "edited-kernel")
    assert tune_cache.fingerprint("NVIDIA H100 80GB HBM3", "9.0") != base


def test_cache_dir_and_switch_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("STAGEHAND_CACHE_DIR", str(tmp_path))
    assert tune_cache.cache_dir() == str(tmp_path)
    monkeypatch.setenv("STAGEHAND_TUNE_CACHE", "0")
    assert not tune_cache.enabled()
