"""`torch_stagehand.__version__`: the installed distribution's version, else the source tree's pyproject.toml.

`stagehand --version` prints the same string. A checkout put on the path without being
installed has no package metadata; its pyproject.toml (beside the package folders) still
says which version the code is.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import PackageNotFoundError, version as _dist_version

DISTRIBUTION = "torch-stagehand"
UNKNOWN = "0+unknown"  # a valid PEP 440 version that sorts below every release
_PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")


def source_version(pyproject: str | None = None) -> str | None:
    """The version a source checkout's pyproject.toml names, or None if it is not this project's.

    Read with a pattern, not tomllib: Python 3.10 (which the project supports) has no tomllib,
    and the `[project]` table's two plain string keys are all that is needed."""
    try:
        with open(pyproject or _PYPROJECT, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    table = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    keys = dict(re.findall(r'^(name|version)\s*=\s*"([^"]*)"', table.group(1), re.M)) if table else {}
    return keys.get("version") if keys.get("name") == DISTRIBUTION else None


def read_version() -> str:
    try:
        return _dist_version(DISTRIBUTION)
    except PackageNotFoundError:
        return source_version() or UNKNOWN


__version__ = read_version()
