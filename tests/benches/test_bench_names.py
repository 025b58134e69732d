"""A bench runs as `python benches/NAME.py`, which puts benches/ first on sys.path: a bench named like an
installed module would be imported in its place (benches/kernels.py once hid Hugging Face's `kernels`, which
transformers imports, and every bench importing transformers failed)."""

from __future__ import annotations

import importlib.machinery
import os
import sys

from _helpers import ROOT


def test_no_bench_script_is_named_like_an_installed_module():
    ours = (str(ROOT), str(ROOT / "benches"), str(ROOT / "tests"))  # the checkout's folders (a venv inside it kept)
    outside = [p for p in sys.path if not any(os.path.abspath(p or ".") == o or
                                              os.path.abspath(p or ".").startswith(o + os.sep) for o in ours[1:])
               and os.path.abspath(p or ".") != ours[0]]
    names = sorted(f[:-3] for f in os.listdir(ROOT / "benches") if f.endswith(".py"))
    assert "budget_sweep" in names
    shadowed = [n for n in names if n in sys.builtin_module_names
                or importlib.machinery.PathFinder.find_spec(n, outside) is not None]
    assert shadowed == [], f"benches/{shadowed[0]}.py hides the installed module of that name"
