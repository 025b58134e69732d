"""A slab build killed in the middle of its write (SIGKILL: no cleanup runs) leaves the slab that was there
before, byte for byte, or none: never a torn file under the slab's names. Killed between its two renames
(the data file's, the manifest's), the new data file beside the old manifest is refused when opened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from torch_stagehand.runtime.slab import SlabError, SlabReader
from test_slab import build, make_toy
from _helpers import TESTS

CHILD = textwrap.dedent("""
    import os, sys
    sys.path[:0] = [{tests!r}, {here!r}]  # _helpers, test_slab
    from torch_stagehand.runtime.slab import builder
    from test_slab import build, make_toy
    import pathlib

    real_replace, calls = os.replace, []

    def replace_after_the_parent_kills_us(src, dst):
        calls.append(dst)
        if len(calls) == {at_rename}:
            print("written", src, flush=True)  # the new bytes are all in the temporary file
            sys.stdin.read()  # blocks: the parent kills this process here, before this rename
        real_replace(src, dst)

    builder.os.replace = replace_after_the_parent_kills_us
    build(make_toy(seed={seed}), pathlib.Path({out!r}))
""")


def _killed_build(tmp_path, seed: int, at_rename: int = 1) -> None:
    """Build a slab in a child killed before its `at_rename`-th rename (1: the data file's, 2: the manifest's)."""
    code = CHILD.format(tests=str(TESTS), here=os.path.dirname(os.path.abspath(__file__)), seed=seed, out=str(tmp_path), at_rename=at_rename)
    child = subprocess.Popen([sys.executable, "-c", code],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("written"), f"the build did not reach its rename: {line!r}"
        assert os.path.getsize(line.split()[1]) > 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL


def _slab_files(folder) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read()
            for name in sorted(os.listdir(folder)) if name.endswith((".safetensors", ".manifest.json"))}


def test_a_killed_first_build_leaves_no_slab(tmp_path):
    _killed_build(tmp_path, seed=1)
    assert _slab_files(tmp_path / "s") == {}


def test_a_killed_rebuild_leaves_the_old_slab_byte_for_byte(tmp_path):
    build(make_toy(seed=0), tmp_path)
    before = _slab_files(tmp_path / "s")
    assert set(before) == {"s.safetensors", "s.manifest.json"}
    _killed_build(tmp_path, seed=1)  # other weights: a torn or new file would differ
    assert _slab_files(tmp_path / "s") == before


def test_a_rebuild_killed_between_its_renames_is_refused_when_opened(tmp_path):
    build(make_toy(seed=0), tmp_path)
    _killed_build(tmp_path, seed=1, at_rename=2)  # the new data file is in place, the manifest is the old one
    with pytest.raises(SlabError):
        SlabReader(str(tmp_path / "s" / "s.manifest.json"))
