"""Warm starts: a unit compiled once is loaded, not compiled, by the next process. Units compile through AOTAutograd
and Inductor, whose own caches keep them; what would make them step aside is handled here and in inner.py (a ShapeEnv
for static inputs too; our in-graph functions marked cacheable under a hash of their source). `track` says how each
compile went. A fresh node keeps no TORCHINDUCTOR_CACHE_DIR: `CompileBundle` writes what this process compiled or
loaded to one file per model (a header with the versions, the device and the payload's sha256) and loads it before
the first compile; a mismatched file is ignored, said once."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from torch_stagehand.runtime.atomic_file import write_atomic
from torch_stagehand.runtime.conductor.costs import cache_dir

log = logging.getLogger("torch_stagehand.compiler")

_MAGIC = b"STAGEHAND-COMPILE-BUNDLE"
_FORMAT = 1


# ---- making units cacheable ------------------------------------------------------------------

def _sources_hash(modules: list[Any]) -> str:
    """A hash of the source files of these modules and packages (every .py file of a package)."""
    files: list[str] = []

    def name(m: Any) -> str:
        return getattr(m, "__name__", None) or str(getattr(m, "__path__", ""))

    for module in sorted({id(m): m for m in modules}.values(), key=name):  # not import order: it varies
        paths = getattr(module, "__path__", None)
        if paths:  # a package: all its modules, their names sorted
            files += sorted(os.path.join(root, name) for root in paths for name in os.listdir(root)
                            if name.endswith(".py"))
        else:
            files.append(inspect.getsourcefile(module))
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def cacheable_functions() -> dict[str, str]:
    """The Python functions our variant graphs call, for `unsafe_marked_cacheable_functions`: name -> a hash of
    the source deciding what they trace to (the ops, the precisions, the kernels, each function's own module)."""
    from torch_stagehand import kernels
    from torch_stagehand.kernels import tuning
    from torch_stagehand.runtime import ops, precision
    from torch_stagehand.runtime.precision.traced import IN_GRAPH_FUNCTIONS

    own = [inspect.getmodule(fn) for fn in IN_GRAPH_FUNCTIONS]
    source = _sources_hash(list(dict.fromkeys([ops, precision, kernels, tuning, *own])))
    return {f"{fn.__module__}.{fn.__name__}": source for fn in (ops.grad_tap, *IN_GRAPH_FUNCTIONS)}


def ops_fingerprint() -> str:
    """A hash of the modules registering the stagehand ops, whose fake and autograd rules every unit traces."""
    from torch_stagehand.runtime import ops
    from torch_stagehand.runtime.experts import stacks as experts

    return _sources_hash([ops, experts])


# ---- keys that do not depend on import order ------------------------------------------------------

def memory_format_named(name: str) -> torch.memory_format:
    """`torch.<name>` (what a cache key's pickle of a memory format names; hashed, never loaded)."""
    return getattr(torch, name.rpartition(".")[2])


@contextlib.contextmanager
def import_order_free_keys() -> Iterator[None]:
    """Around a unit's compile: torch's cache-key pickler names a memory format by the first module in
    `sys.modules` reaching it, which depends on import order; here it names it by `memory_format_named`."""
    from torch._inductor.codecache import FxGraphCachePickler

    original = FxGraphCachePickler.__dict__["__init__"]

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.dispatch_table[torch.memory_format] = lambda form: (memory_format_named, (str(form),))

    FxGraphCachePickler.__init__ = init
    try:
        yield
    finally:
        FxGraphCachePickler.__init__ = original


# ---- how one compile went --------------------------------------------------------------------

@dataclass
class CompileOutcome:
    """"hit" (loaded from AOTAutograd's cache), "miss" (compiled, and stored for the next process),
    "bypass: <why>" (compiled, not storable), or "uncached" (the eager inner compiler keeps nothing)."""

    state: str = "uncached"

    @property
    def loaded(self) -> bool:
        return self.state == "hit"


class _BypassReasons(logging.Handler):
    """AOTAutograd says why it steps aside only in its log: keep the reason."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "Bypassing autograd cache" in text:
            self.reasons.append(text.split("due to:", 1)[-1].strip().splitlines()[0].strip())


@contextlib.contextmanager
def track() -> Iterator[CompileOutcome]:
    """Around one unit's compile: which of AOTAutograd's counters moved says how it went."""
    from torch._dynamo.utils import counters

    outcome = CompileOutcome()
    before = dict(counters["aot_autograd"])
    logger = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    handler, level = _BypassReasons(), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield outcome
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    moved = {k for k, v in counters["aot_autograd"].items() if v != before.get(k, 0)}
    if moved & {"autograd_cache_hit", "autograd_cache_miss"}:
        outcome.state = "hit" if "autograd_cache_hit" in moved else "miss"
    elif "autograd_cache_bypass" in moved:
        outcome.state = "bypass: " + (handler.reasons[0] if handler.reasons else "no reason given")


# ---- the bundle file ---------------------------------------------------------------------------

def _environment(device: torch.device) -> dict[str, str]:
    """What a bundle must have been written under to be loaded here."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    device_name = f"{props.name} sm{props.major}{props.minor}" if props is not None else device.type
    # No stagehand version: what stagehand puts in a unit is in torch's own keys already.
    return {"torch": torch.__version__, "triton": triton_version, "device": device_name}


class CompileBundle:
    """One model's compiled units on disk: a header line of JSON, then torch's serialized cache artifacts."""

    def __init__(self, path: str, device: torch.device):
        self.path = path
        self.env = _environment(device)
        self.loaded_artifacts = 0  # artifacts put back into torch's caches by `load`
        self.message: str | None = None  # what `load` found (one line), for the offload report and logs
        self.last_run_units = 0  # the units the run that wrote the file had compiled or loaded (progress estimate)

    @staticmethod
    def for_model(name: str, device: torch.device) -> "CompileBundle":
        return CompileBundle(os.path.join(cache_dir(), "compile", f"{name}.bundle"), device)

    def load(self) -> bool:
        """Put the file's artifacts into torch's caches; False (and `message` says why) when it is not used."""
        if not os.path.exists(self.path):
            self.message = f"no compile cache yet at {self.path}: this run compiles cold and writes it"
            return False
        try:
            with open(self.path, "rb") as f:
                header, payload = _split(f.read())
        except (OSError, ValueError) as e:
            return self._ignored(f"unreadable ({e})")
        written = header.get("env", {})
        mismatch = [f"{k} {written.get(k)!r} (here {v!r})" for k, v in self.env.items() if written.get(k) != v]
        if mismatch:
            return self._ignored("written under " + ", ".join(mismatch))
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return self._ignored("corrupt (its payload does not match its sha256)")
        info = _load_artifacts(payload)
        if info is None:
            return self._ignored("torch could not read its artifacts")
        self.loaded_artifacts = sum(len(v) for v in _artifact_lists(info))
        self.last_run_units = int(header.get("units", 0) or 0)
        self.message = f"compile cache {self.path}: {self.loaded_artifacts} artifacts loaded"
        log.info("stagehand: %s", self.message)
        return True

    def _ignored(self, why: str) -> bool:
        self.message = f"compile cache {self.path} ignored: {why}"
        log.warning("stagehand: %s", self.message)
        return False

    def save(self, units: int = 0, even_empty: bool = False) -> bool:
        """Write every artifact this process compiled or loaded so far, and `units`; False when there is none or
        the folder is not writable. `even_empty`: write it anyway (units from this run's ahead-compile workers are
        in no process's artifacts, but the next run must know the model was compiled)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None and not even_empty:
            return False
        payload = saved[0] if saved is not None else _no_artifacts()
        artifacts = sum(len(v) for v in _artifact_lists(saved[1])) if saved is not None else 0
        header = {"format": _FORMAT, "env": self.env, "sha256": hashlib.sha256(payload).hexdigest(),
                  "artifacts": artifacts, "units": units}
        try:
            write_atomic(self.path, _join(header, payload))
            return True
        except OSError as e:
            log.warning("stagehand: compile cache %s not written: %s", self.path, e)
            return False


def _load_artifacts(payload: bytes) -> Any:
    """`torch.compiler.load_cache_artifacts`, keeping every chunk (one per save; torch keeps each kind's last)."""
    try:
        from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache
        from torch.utils._appending_byte_serializer import AppendingByteSerializer
    except ImportError:  # another torch layout: its public loader (the last chunk of each kind)
        return torch.compiler.load_cache_artifacts(payload)
    try:
        CacheArtifactManager._ensure_cache_artifacts_registered()
        chunks = AppendingByteSerializer.to_list(payload, deserialize_fn=_deserialize_single_cache)
    except Exception as e:  # noqa: BLE001 - a payload torch cannot read is reported, never half-used
        log.warning("stagehand: compile cache artifacts unreadable: %s", e)
        return None
    merged: dict[str, list] = {}
    for kind, artifacts in chunks:
        merged.setdefault(kind, []).extend(artifacts)
    return CacheArtifactManager.populate_caches(merged)


def _no_artifacts() -> bytes:
    """An artifact payload with none in it, as torch writes one."""
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    return AppendingByteSerializer(serialize_fn=lambda writer, item: None).to_bytes()


def _artifact_lists(info: Any) -> list[list]:
    artifacts = getattr(info, "artifacts", {})
    return list(artifacts.values()) if isinstance(artifacts, dict) else []


def _join(header: dict, payload: bytes) -> bytes:
    text = json.dumps(header, sort_keys=True).encode()
    return _MAGIC + struct.pack("<I", len(text)) + text + payload


def _split(data: bytes) -> tuple[dict, bytes]:
    if not data.startswith(_MAGIC):
        raise ValueError("not a stagehand compile bundle")
    start = len(_MAGIC) + 4
    if len(data) < start:
        raise ValueError("truncated header")
    (size,) = struct.unpack("<I", data[len(_MAGIC):start])
    header = json.loads(data[start:start + size])
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise ValueError(f"format {header.get('format') if isinstance(header, dict) else '?'} (this reads {_FORMAT})")
    return header, data[start + size:]
