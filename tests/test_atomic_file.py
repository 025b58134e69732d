"""`runtime/atomic_file.write_atomic`: a write that fails part-way leaves the old file whole and nothing else."""

from __future__ import annotations

import os

import pytest

from torch_stagehand.runtime import atomic_file
from torch_stagehand.runtime.atomic_file import write_atomic


def test_a_write_replaces_the_file_and_makes_its_folder(tmp_path):
    path = tmp_path / "new" / "table.json"
    write_atomic(str(path), "old")
    write_atomic(str(path), b"new bytes")
    assert path.read_bytes() == b"new bytes" and os.listdir(path.parent) == ["table.json"]


def test_a_write_that_fails_before_the_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "bundle"
    write_atomic(str(path), b"the old one")

    def no_rename(src, dst):
        assert os.path.getsize(src) == len(b"half of a new one")  # the new bytes were written, elsewhere
        raise OSError("disk full")

    monkeypatch.setattr(atomic_file.os, "replace", no_rename)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(str(path), b"half of a new one")
    assert path.read_bytes() == b"the old one" and os.listdir(tmp_path) == ["bundle"]
