"""A CUDA call that takes a kernel's reference twin because Triton failed to import warns once, naming the
import error. The failure is simulated in a child interpreter (Triton blocked before anything imports it),
so this process's modules, Triton's included, are untouched; CUDA is a tensor that says it is on CUDA."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import sys, warnings
    sys.modules["triton"] = None  # `import triton` now raises ImportError, as a broken install does

    import torch

    class OnCuda(torch.Tensor):  # takes the CUDA branch of the dispatch; computes on the CPU
        @property
        def is_cuda(self):
            return True

    from torch_stagehand import kernels
    from torch_stagehand.kernels import fp8_quant
    from torch_stagehand.kernels.fallback import TritonUnavailableWarning

    assert not kernels.HAS_TRITON and isinstance(kernels.TRITON_IMPORT_ERROR, ImportError), kernels.TRITON_IMPORT_ERROR
    assert not fp8_quant.HAS_TRITON and isinstance(fp8_quant.TRITON_IMPORT_ERROR, ImportError)
    torch.manual_seed(0)
    q, scale = kernels.quantize_per_row(torch.randn(8, 16))
    x = torch.randn(3, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu = kernels.int8_linear(x, q, scale)  # the CPU path: the twin by design, no warning
        assert not caught, [str(w.message) for w in caught]
        y = kernels.int8_linear(x.as_subclass(OnCuda), q, scale)
        dx = kernels.int8_linear_grad_input(torch.randn(3, 8).as_subclass(OnCuda), q, scale)
        for _ in range(2):
            fp8_quant.quantize_rows(torch.randn(4, 16).as_subclass(OnCuda))
    torch.testing.assert_close(y.as_subclass(torch.Tensor), cpu)  # the reference path's numbers
    assert dx.shape == (3, 16)
    fallback = [str(w.message) for w in caught if issubclass(w.category, TritonUnavailableWarning)]
    assert len(fallback) == 2, fallback  # once for the W8A16 kernels, once for the fp8 ones
    for message, module in zip(fallback, (kernels, fp8_quant)):  # each names its own import error
        error = module.TRITON_IMPORT_ERROR
        assert f"{type(error).__name__}: {error}" in message and "triton" in str(error), message
    assert "W8A16 kernels" in fallback[0] and "fp8 quantize" in fallback[1]
    print("ok")
""")


def test_cuda_calls_without_triton_warn_once_per_kernel_family_naming_the_import_error():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


SHADOW_CHILD = textwrap.dedent("""
    import importlib.machinery, os, sys
    root = sys.argv[1]
    assert os.path.abspath(sys.path[0] or ".") == root  # `python -c` in the root: its folders importable by name
    if sys.argv[2] == "absent":  # Hugging Face's `kernels` not installed: the root's folder is the only one found
        find = importlib.machinery.PathFinder.find_spec
        importlib.machinery.PathFinder.find_spec = classmethod(
            lambda cls, name, path=None, target=None: None if name == "kernels" and path is not None
            else find(name, path, target))
        try:
            import kernels
        except ModuleNotFoundError as e:
            assert e.name == "kernels" and "kernels" not in sys.modules
            print("ok")
            sys.exit(0)
        raise AssertionError(f"the root's kernels/ imported as `kernels`: {kernels.__file__}")
    import kernels
    assert kernels.__file__ != os.path.join(root, "kernels", "__init__.py"), kernels.__file__
    from transformers import LlamaConfig, LlamaForCausalLM  # transformers imports `kernels` where it is installed
    import torch_stagehand.kernels as ours
    assert ours.__file__.startswith(os.path.join(root, "kernels")), ours.__file__
    print("ok")
""")


def test_the_repository_root_on_sys_path_does_not_shadow_hugging_faces_kernels():
    """Python started in the repository's root finds the folder `kernels/` as a top-level `kernels`; imported so,
    it hands that name to Hugging Face's package (which transformers imports), or fails as a missing module where
    that is not installed, so `import transformers` works from the root."""
    root = str(Path(__file__).resolve().parents[2])
    outside = [p for p in sys.path if os.path.abspath(p or ".") != root]
    installed = importlib.machinery.PathFinder.find_spec("kernels", outside) is not None
    for case in ("installed", "absent") if installed else ("absent",):  # (transformers < 5.2x: not installed)
        result = subprocess.run([sys.executable, "-c", SHADOW_CHILD, root, case], capture_output=True, text=True,
                                timeout=300, cwd=root)
        assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (case, result.stderr[-3000:])
