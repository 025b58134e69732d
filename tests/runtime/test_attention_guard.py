"""cuDNN SDPA is turned off (once, with a warning) for CUDA runtimes; nothing changes elsewhere."""

from __future__ import annotations

import warnings

import pytest
import torch

from torch_stagehand.runtime.attention_guard import AttentionBackendWarning, disable_unsafe_sdpa_backends


@pytest.fixture
def fake_cudnn_switch(monkeypatch):
    state = {"on": True}
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: state["on"])
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: state.update(on=on))
    monkeypatch.delenv("STAGEHAND_ALLOW_CUDNN_SDPA", raising=False)
    return state


def test_cuda_runtimes_turn_cudnn_sdpa_off_once_and_the_last_one_closed_gives_it_back(fake_cudnn_switch):
    with pytest.warns(AttentionBackendWarning, match="cuDNN"):
        first = disable_unsafe_sdpa_backends(torch.device("cuda"))
    assert fake_cudnn_switch["on"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = disable_unsafe_sdpa_backends(torch.device("cuda"))  # already off: no second word
    first()
    assert fake_cudnn_switch["on"] is False  # the second runtime still needs it off
    second()
    assert fake_cudnn_switch["on"] is True


def test_a_user_who_turned_it_off_keeps_it_off(fake_cudnn_switch):
    fake_cudnn_switch["on"] = False
    assert disable_unsafe_sdpa_backends(torch.device("cuda")) is None
    assert fake_cudnn_switch["on"] is False


def test_cpu_runtimes_and_the_opt_out_leave_it_alone(fake_cudnn_switch, monkeypatch):
    assert disable_unsafe_sdpa_backends(torch.device("cpu")) is None
    monkeypatch.setenv("STAGEHAND_ALLOW_CUDNN_SDPA", "1")
    assert disable_unsafe_sdpa_backends(torch.device("cuda")) is None
    assert fake_cudnn_switch["on"] is True
