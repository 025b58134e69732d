"""`runtime/atomic_file.write_atomic`: a write that fails part-way leaves the old file whole and nothing else."""

from __future__ import annotations

import os

import pytest

from torch_stagehand.runtime import atomic_file
from torch_stagehand.runtime.atomic_file import write_atomic
from _helpers import ROOT


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


# Writers that must stay in place: a temporary file that is renamed by its caller, an append-only log, a
# kernel interface (cgroup limits, /proc), a child's result part read only after the child exited.
IN_PLACE = {
    "runtime/atomic_file.py": "the temporary file itself",
    "runtime/slab/safetensors_io.py": "writes the slab's temporary file; builder.py renames it",
    "runtime/slab/manifest.py": "writes a temporary file and renames it",
    "runtime/slab/report.py": "writes a temporary file and renames it",
    "runtime/selective/calibration.py": "writes a temporary file and renames it",
    "benches/host_memory.py": "cgroup interface files",
    "benches/_common.py": "/proc/self/clear_refs",
    "benches/full_finetune.py": "a child's result part, read after it exited",
    "benches/slab_build.py": "/proc/self/clear_refs; a child's result part, read after it exited",
    "benches/soak.py": "an append-only JSONL of steps, one record a line",
    "benches/start_time.py": "/proc/sys/vm/drop_caches; an empty marker written after its files were complete",
    "kernels/tuning/cache.py": "writes a temporary file (mkstemp) and renames it",
    "runtime/conductor/telemetry.py": "an append-only JSONL; a killed run's torn last line is skipped on reading",
    "runtime/selective/telemetry.py": "an append-only JSONL, one record a line",
}


def test_every_file_the_project_writes_goes_through_a_rename():
    """A run killed mid-write must leave the old file or the new one: every `open(..., "w")` in the
    project is write_atomic's or on the list above, with its reason."""
    import re

    root = ROOT
    writes = re.compile(r"""open\([^)]*["'](w|wb|a|ab|x)["']""")
    found = set()
    for folder in ("runtime", "stagehand", "compiler", "kernels", "benches"):
        for path in (root / folder).rglob("*.py"):
            if writes.search(path.read_text()):
                found.add(str(path.relative_to(root)))
    assert found - set(IN_PLACE) == set(), "writes a file in place (use runtime/atomic_file.write_atomic)"
    for path in IN_PLACE:
        assert (root / path).exists(), f"{path} is on the list but gone"


def test_a_written_file_has_the_mode_a_plain_open_gives_and_keeps_an_existing_files(tmp_path):
    import os

    from torch_stagehand.runtime.atomic_file import write_atomic

    plain, atomic = tmp_path / "plain.json", tmp_path / "atomic.json"
    plain.write_text("{}")
    write_atomic(str(atomic), "{}")
    assert os.stat(atomic).st_mode & 0o777 == os.stat(plain).st_mode & 0o777  # not mkstemp's 0600
    os.chmod(atomic, 0o640)
    write_atomic(str(atomic), "{}")
    assert os.stat(atomic).st_mode & 0o777 == 0o640
