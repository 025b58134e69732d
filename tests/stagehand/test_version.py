"""`torch_stagehand.__version__` (package metadata, else the checkout's pyproject.toml), `stagehand --version`
prints the same, and pyproject.toml's license is the SPDX string setuptools reads without a deprecation warning."""

from __future__ import annotations

import os
import warnings
from importlib.metadata import PackageNotFoundError, version

import pytest

import torch_stagehand
from torch_stagehand import version as stagehand_version
from torch_stagehand.app.cli import main
from _helpers import ROOT



def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_the_installed_distributions():
    assert torch_stagehand.__version__ == version("torch-stagehand")
    assert "__version__" in torch_stagehand.__all__


def test_a_source_checkout_without_metadata_reads_its_pyproject(monkeypatch, tmp_path):
    def not_installed(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(stagehand_version, "_dist_version", not_installed)
    assert stagehand_version.read_version() == _pyproject()["project"]["version"]
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "someone-else"\nversion = "9.9"\n')
    assert stagehand_version.source_version(str(other)) is None  # another project's file says nothing
    monkeypatch.setattr(stagehand_version, "_PYPROJECT", str(tmp_path / "missing.toml"))  # neither source
    assert stagehand_version.read_version() == stagehand_version.UNKNOWN


def test_the_command_prints_the_same_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"stagehand (torch-stagehand) {torch_stagehand.__version__}\n"


def test_the_license_is_an_spdx_string_setuptools_reads_without_a_warning(monkeypatch):
    pytest.importorskip("setuptools", minversion="77")  # the first that reads `license` as SPDX (PEP 639)
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    project = _pyproject()
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]
    monkeypatch.chdir(ROOT)  # the file's relative paths (readme, package dirs) resolve from its folder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), os.path.join(ROOT, "pyproject.toml"))
    assert [str(w.message) for w in caught if "license" in str(w.message).lower()] == []
    assert dist.metadata.license_expression == "Apache-2.0"
