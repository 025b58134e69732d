"""The per-job guides' Python is true to the API: every code block of docs/guide/lora-diffusion.md and
docs/guide/lora-llm.md compiles, and every keyword it gives `offload(...)`, `Config(...)`,
`ConductorConfig(...)`, `PrecisionConfig(...)`, `HostAdamW(...)`, `rt.replan(...)` or the backend's
`options={...}` is a real parameter or field. CPU only: nothing is run."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import torch_stagehand as stagehand
from torch_stagehand.compiler.context import BackendOptions
from torch_stagehand.optim import HostAdamW
from torch_stagehand.runtime.runtime import Runtime

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ("docs/guide/lora-diffusion.md", "docs/guide/lora-llm.md")
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _parameters(fn) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# A call's name (the last part of `a.b.name(...)`) -> the keywords it takes.
KEYWORDS = {
    "offload": _parameters(stagehand.offload),
    "Config": _fields(stagehand.Config),
    "ConductorConfig": _fields(stagehand.ConductorConfig),
    "PrecisionConfig": _fields(stagehand.PrecisionConfig),
    "HostAdamW": _parameters(HostAdamW.__init__),
    "replan": _parameters(Runtime.replan),
}


def _blocks(guide: str) -> list[tuple[int, str]]:
    text = (ROOT / guide).read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


def _all_blocks():
    return [pytest.param(guide, line, src, id=f"{guide.rsplit('/', 1)[1]}:{line}")
            for guide in GUIDES for line, src in _blocks(guide)]


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def test_each_guide_has_python_and_offloads():
    for guide in GUIDES:
        blocks = _blocks(guide)
        assert blocks, f"{guide}: no python code block"
        assert any("stagehand.offload(" in src for _, src in blocks), f"{guide}: no offload call"
        assert any('backend="stagehand"' in src for _, src in blocks), f"{guide}: no compile with the backend"


@pytest.mark.parametrize("guide, line, src", _all_blocks())
def test_a_code_block_compiles_and_names_real_keywords(guide, line, src):
    tree = ast.parse(compile(src, f"{guide}:{line}", "exec", ast.PyCF_ONLY_AST))
    compile(tree, f"{guide}:{line}", "exec")
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        known = KEYWORDS.get(name)
        for kw in node.keywords:
            if kw.arg is None:
                continue
            if known is not None and kw.arg not in known:
                problems.append(f"line {node.lineno}: {name}({kw.arg}=...) is not one of {sorted(known)}")
            if name == "compile" and kw.arg == "options" and isinstance(kw.value, ast.Dict):
                for key in kw.value.keys:
                    if isinstance(key, ast.Constant) and key.value not in _fields(BackendOptions):
                        problems.append(f"line {node.lineno}: backend option {key.value!r} is unknown")
    assert not problems, f"{guide}, the block at line {line}:\n" + "\n".join(problems)


def test_the_guides_inline_offload_keywords_are_real():
    """Keywords the prose gives in inline code, `offload(..., name=...)` or `name="..."` beside offload's
    own arguments, are offload's or Config's."""
    known = KEYWORDS["offload"] | KEYWORDS["Config"]
    for guide in GUIDES:
        text = (ROOT / guide).read_text()
        for span in re.findall(r"`(?:stagehand\.)?offload\(([^`]*)\)`", text):
            for name in re.findall(r"(\w+)=", span):
                assert name in known, f"{guide}: offload({name}=...) in the prose is not a parameter"
        for span in re.findall(r"`Config\(([^`]*)\)`", text):
            for name in re.findall(r"(\w+)=", span):
                assert name in KEYWORDS["Config"], f"{guide}: Config({name}=...) in the prose is not a field"
