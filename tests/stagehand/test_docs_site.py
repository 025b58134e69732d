"""The documentation site builds with every warning an error (broken links, missing pages, API entries that do not
resolve), and its API reference documents every public argument."""

from __future__ import annotations

import dataclasses
import inspect
import os
import runpy
import subprocess
import sys

import pytest

import torch_stagehand as stagehand
from torch_stagehand.compiler.context import BackendOptions
from torch_stagehand.optim import HostAdamW
from _helpers import ROOT



def test_the_site_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    api = (tmp_path / "reference" / "api" / "index.html").read_text()
    for name in ("offload", "compile_blocks", "HostAdamW", "BackendOptions", "Config", "vram_budget"):
        assert name in api
    home = (tmp_path / "index.html").read_text()
    assert "vram_budget" in home and 'href="guide/offload/"' in home  # README's docs/ links point into the site


def _undocumented(obj, names) -> list[str]:
    """The names neither the docstring of `obj` mentions nor (a dataclass's fields) a docstring of their own
    documents, as the API reference reads them (griffe, from the source)."""
    import griffe

    text = inspect.getdoc(obj) or ""
    documented = set()
    if dataclasses.is_dataclass(obj):
        module = griffe.load(obj.__module__, search_paths=[os.path.join(ROOT, ".docs-sources")],
                             allow_inspection=False)
        documented = {name for name, m in module[obj.__name__].members.items() if m.docstring is not None}
    return [n for n in names if n not in documented and n not in text]


@pytest.mark.parametrize("obj", [stagehand.offload, stagehand.compile_blocks, stagehand.explain, HostAdamW],
                         ids=lambda o: o.__name__)
def test_every_argument_of_a_public_call_is_documented(obj):
    skip = {"self", "model", "params", "kwargs", "compile_kwargs"}
    target = obj.__init__ if inspect.isclass(obj) else obj
    names = [p for p in inspect.signature(target).parameters if p not in skip]
    assert _undocumented(obj, names) == []


@pytest.mark.parametrize("cls", [stagehand.Config, stagehand.PrecisionConfig, stagehand.ConductorConfig,
                                 BackendOptions], ids=lambda c: c.__name__)
def test_every_field_of_a_settings_class_is_documented(cls):
    runpy.run_path(os.path.join(ROOT, "docs", "site_hooks.py"))  # links the source tree griffe reads
    assert _undocumented(cls, [f.name for f in dataclasses.fields(cls)]) == []
