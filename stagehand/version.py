"""`torch_stagehand.__version__` (and `stagehand --version`): the installed distribution's version, else the
version the source tree's pyproject.toml names (a checkout put on the path without being installed)."""

from __future__ import annotations

import os
import re
from importlib.metadata import PackageNotFoundError, version as _dist_version

DISTRIBUTION = "torch-stagehand"
UNKNOWN = "0+unknown"  # a valid PEP 440 version that sorts below every release
_PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")


def source_version(pyproject: str | None = None) -> str | None:
    """The version a source checkout's pyproject.toml names, or None if it is not this project's (read with a
    pattern: Python 3.10 has no tomllib)."""
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
