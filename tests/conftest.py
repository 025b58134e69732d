"""Shared pytest set-up: `gpu` tests skip without CUDA (the marker is registered in pyproject); `patch_config`."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

# Tests tune W8A16 configs from scratch: a choice a previous run left on disk must not decide them.
os.environ["STAGEHAND_TUNE_CACHE"] = "0"
# Nor may a compile bundle (compiler/startup/compile_cache.py) carry units from one test (or run) to the next:
# tests/compiler/test_compile_cache.py turns it on in the processes it starts.
os.environ["STAGEHAND_COMPILE_CACHE"] = "0"
# Nor a calibrated cost model (runtime/conductor/cost_cache.py): every test on a GPU calibrates.
os.environ["STAGEHAND_COST_CACHE"] = "0"
# Nor ahead-compile worker processes for every model a GPU test offloads (on by default on CUDA): the tests of
# the workers turn them on.
os.environ.setdefault("STAGEHAND_AHEAD_WORKERS", "0")


@pytest.fixture
def patch_config():
    """`patch_config(name=value, ...)`: `torch_stagehand.config.patch` until the test ends (a variable or a tunable)."""
    from torch_stagehand import config

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(config.patch(**changes))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
