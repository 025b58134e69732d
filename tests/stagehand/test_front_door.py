"""What importing the library loads: the front door never the app, the slab format never its loader.

The app (CLI, demo, presets, plots) builds on the library, never the reverse,
so `import torch_stagehand` must not pull it in (nor matplotlib, argparse
code, presets that import transformers). The slab package keeps its one
dependency on the streaming engine in `slab.loading`, which its public
surface does not import. Checked in a fresh interpreter, where `sys.modules`
shows what an import really loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after(statement: str) -> set[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_importing_the_library_loads_no_part_of_the_app():
    loaded = _modules_after("import torch_stagehand; torch_stagehand.offload, torch_stagehand.explain")
    assert "torch_stagehand.api" in loaded  # the check sees the front door's own modules
    assert not any(m == "torch_stagehand.app" or m.startswith("torch_stagehand.app.") for m in loaded)


def test_the_slab_surface_does_not_import_its_loader():
    loaded = _modules_after("import torch_stagehand.runtime.slab as s; s.SlabReader, s.build_slab_from_checkpoint")
    assert {"torch_stagehand.runtime.slab.reader", "torch_stagehand.runtime.slab.checkpoint"} <= loaded
    assert "torch_stagehand.runtime.slab.loading" not in loaded
