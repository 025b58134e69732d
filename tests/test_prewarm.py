"""offload() on CUDA imports the compiler's modules on a thread while it works: in a fresh process they are not
imported before, they are after the thread ends, and asking twice starts one thread."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import torch_stagehand
from torch_stagehand.compiler.inner import prewarm_compiler_imports
before = "torch._inductor.compile_fx" in sys.modules
thread = prewarm_compiler_imports()
thread.join()
print(before, "torch._inductor.compile_fx" in sys.modules, prewarm_compiler_imports() is thread, thread.daemon)
"""


def test_the_compiler_imports_come_up_on_a_thread_once():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True", "True"]
