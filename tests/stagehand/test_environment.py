"""The environment, read in one place (stagehand/environment.py): typed values, defaults, one-line errors."""

import os

import pytest

from torch_stagehand.app.cli import main
from torch_stagehand.runtime.config import ConfigError
from torch_stagehand.environment import VARIABLES, cache_dir, env, set_env
from _helpers import ROOT



def test_values_are_typed_and_default_when_unset(monkeypatch):
    monkeypatch.delenv("STAGEHAND_TUNE_THREADS", raising=False)
    assert env("STAGEHAND_TUNE_THREADS") == 8
    monkeypatch.setenv("STAGEHAND_TUNE_THREADS", "3")
    assert env("STAGEHAND_TUNE_THREADS") == 3
    monkeypatch.setenv("STAGEHAND_COMPILE_CACHE", "0")
    assert env("STAGEHAND_COMPILE_CACHE") is False
    monkeypatch.setenv("STAGEHAND_COMPILE_CACHE", "")
    assert env("STAGEHAND_COMPILE_CACHE") is True  # empty is unset
    monkeypatch.setenv("STAGEHAND_CACHE_DIR", "/tmp/somewhere")
    assert cache_dir() == "/tmp/somewhere"


@pytest.mark.parametrize("name, value, message", [
    ("STAGEHAND_AHEAD_DEBUG", "maybe", r"STAGEHAND_AHEAD_DEBUG must be 0 or 1 \(or true / false.*got 'maybe'"),
    ("STAGEHAND_AHEAD_WORKERS", "-1", "STAGEHAND_AHEAD_WORKERS must be an int >= 0, got '-1'"),
    ("STAGEHAND_INDUCTOR_AUTOTUNE", "some", "STAGEHAND_INDUCTOR_AUTOTUNE must be one of .* got 'some'"),
])
def test_a_bad_value_names_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        env(name)


def test_other_tools_variables_are_read_as_those_tools_read_them(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "y")  # Triton's own truthy spelling
    assert env("TRITON_INTERPRET") is True
    monkeypatch.setenv("TRITON_INTERPRET", "2")  # not refused here: Triton reads it as off
    assert env("TRITON_INTERPRET") is False
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "-1")
    assert env("TORCHINDUCTOR_COMPILE_THREADS") == -1
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "many")
    assert env("TORCHINDUCTOR_COMPILE_THREADS") is None


def test_set_env_sets_and_removes(monkeypatch):
    monkeypatch.delenv("STAGEHAND_INDUCTOR_AUTOTUNE", raising=False)
    set_env("STAGEHAND_INDUCTOR_AUTOTUNE", "none")
    assert os.environ["STAGEHAND_INDUCTOR_AUTOTUNE"] == "none"
    set_env("STAGEHAND_INDUCTOR_AUTOTUNE", None)
    assert "STAGEHAND_INDUCTOR_AUTOTUNE" not in os.environ
    with pytest.raises(KeyError):
        set_env("STAGEHAND_NOT_A_VARIABLE", "1")


def test_no_other_module_of_the_package_reads_the_environment():
    readers = []
    for folder in ("stagehand", "compiler", "runtime", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if "os.environ" in text or "getenv(" in text:
                readers.append(str(path.relative_to(ROOT)))
    assert readers == ["stagehand/environment.py"]


def test_every_variable_the_package_names_is_in_the_table():
    import re

    named = set()
    for folder in ("stagehand", "compiler", "runtime", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            named |= set(re.findall(r"env\(\"([A-Z_]+)\"\)", path.read_text()))
    assert named and named <= set(VARIABLES)


def test_stagehand_env_prints_the_table_and_refuses_a_bad_value(monkeypatch, capsys):
    monkeypatch.setenv("STAGEHAND_TUNE_THREADS", "4")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "STAGEHAND_TUNE_THREADS" in out and "4 -> 4" in out
    monkeypatch.setenv("STAGEHAND_TUNE_THREADS", "four")
    assert main(["env"]) == 2
    assert "STAGEHAND_TUNE_THREADS must be an int >= 0, got 'four'" in capsys.readouterr().err


def test_config_patch_sets_variables_and_tunables_for_its_block_only(monkeypatch):
    from torch_stagehand import config
    from torch_stagehand.environment import TUNABLES, tunable

    monkeypatch.delenv("STAGEHAND_TUNE_THREADS", raising=False)
    monkeypatch.setenv("STAGEHAND_AUTOTUNE", "1")
    with config.patch(STAGEHAND_TUNE_THREADS=3, STAGEHAND_AUTOTUNE=False, weights_file_chunk=1000):
        assert env("STAGEHAND_TUNE_THREADS") == 3 and env("STAGEHAND_AUTOTUNE") is False
        assert tunable("weights_file_chunk") == 1000
    assert "STAGEHAND_TUNE_THREADS" not in os.environ and os.environ["STAGEHAND_AUTOTUNE"] == "1"
    assert tunable("weights_file_chunk") == TUNABLES["weights_file_chunk"]

    @config.patch(oom_regrow_every=2)
    def decorated():
        return tunable("oom_regrow_every")

    assert decorated() == 2 and tunable("oom_regrow_every") == TUNABLES["oom_regrow_every"]


def test_config_patch_refuses_an_unknown_name_and_a_bad_value_and_restores():
    from torch_stagehand import config

    with pytest.raises(ConfigError, match=r"config.patch: unknown setting\(s\) \['weights_file_chunks'\]"):
        with config.patch(weights_file_chunks=1):
            pass
    with pytest.raises(ConfigError, match="STAGEHAND_TUNE_THREADS must be an int >= 0, got 'four'"):
        with config.patch(STAGEHAND_TUNE_THREADS="four"):
            pass
    assert os.environ.get("STAGEHAND_TUNE_THREADS") in (None, "")
    with pytest.raises(ConfigError, match="config.patch: oom_regrow_every must be an int >= 1, got 0"):
        with config.patch(oom_regrow_every=0):
            pass
