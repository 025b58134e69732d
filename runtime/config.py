"""One dataclass tree for every knob, with the seeds' defaults.

`Config.from_json` reads this tree or the seeds' training-config layout
(``{"memory": {"stagehand": {"conductor_config": ..., "selective_precision": ...}}}``); every validation error
names the field by its dotted path. Two knobs appear twice: the top-level one wins, the conductor one is honoured
when it is unset, two different values are an error. Device slots: ``slots``, else ``conductor.h2d_slots`` when
not its default (2), else ``conductor.prefetch_window + 1`` (`Config.slot_count`); telemetry: ``telemetry_file``,
else ``conductor.telemetry_file`` (`Config.telemetry_path`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from torch_stagehand.environment import ConfigError  # one error for a Config field and an environment variable
from torch_stagehand.runtime import precision as precisions

_DEFAULT_H2D_SLOTS = 2


@dataclass
class ConductorConfig:
    """Budgets and transfer slots (conductor.txt). Sizes in MB; None = no cap."""

    enabled: bool = True
    """False: no budget, transfer or policy manager (planned prefetches are issued without admission)."""
    vram_soft_cap_mb: float | None = None
    """The VRAM budget the plan is made for (`offload(vram_budget=...)`, when given, takes its place)."""
    vram_hard_cap_mb: float | None = None
    """Device memory the run never crosses; a plan goes over the soft cap up to it only when none fits."""
    pinned_budget_mb: float | None = None
    """Validated and kept for the seeds' layout; `pin_memory` and the preflight decide page-locking, not this."""
    h2d_slots: int = _DEFAULT_H2D_SLOTS
    """The device slots when Config.slots is unset (see the module docstring)."""
    d2h_slots: int = 2
    """The transfer manager's device-to-host tokens (the seeds' layout); the gradient and spill copies take none."""
    prefetch_window: int = 1
    """How many blocks ahead the plan fetches while the current block computes."""
    backward_pressure_threshold: float = 0.8
    """Rule 1: above this VRAM pressure in BACKWARD, speculative prefetch stops."""
    contention_checks: int = 3
    """Rule 3: this many consecutive "all slots busy" checks shrink the window."""
    telemetry_file: str | None = None
    """The telemetry file when Config.telemetry_file is unset."""
    telemetry_interval_steps: int = 1
    """Validated and kept for the seeds' config layout; the telemetry writes a line every step."""
    debug_event_trace: bool = False
    """Keep an event trace of every admission and denial (debugging)."""

    def validate(self, prefix: str = "conductor") -> None:
        _check(self, f"{prefix}.", _CONDUCTOR_RULES)
        soft, hard = self.vram_soft_cap_mb, self.vram_hard_cap_mb
        if soft is not None and hard is not None and soft > hard:
            raise ConfigError(f"{prefix}.vram_soft_cap_mb: {soft} is above {prefix}.vram_hard_cap_mb {hard}")


@dataclass
class PrecisionConfig:
    """Selective precision (selective-precision.txt), defaults as the seed's."""

    enabled: bool = True
    """False: the policy never runs, whatever `mode` says."""
    mode: str | None = None
    """'off' | "static" | "dynamic"; None: off unless offload(precision="auto") ("dynamic", `effective_mode`)."""
    bf16_threshold: float = 0.6
    """A block whose sensitivity score is at or above this goes (or comes back) to bf16."""
    int8_threshold: float = 0.3
    """A block scored below this goes to fewer bytes (int8, or fp8 by the FP8 policy)."""
    ambiguous_default: str = precisions.FULL
    """The precision of a block scored between the two thresholds that has no starting precision of its own."""
    hysteresis_margin: float = 0.1
    """A bf16 block goes down only below int8_threshold minus this (no flip-flop near a threshold)."""
    grad_weight: float = 0.7
    """The gradient score's share of a block's sensitivity."""
    error_weight: float = 0.3
    """The calibration error's share of a block's sensitivity."""
    grad_sensitivity_threshold: float = 2.0
    """The relative gradient magnitude that scores 1 (the score is capped there)."""
    run_calibration: bool = True
    """Let `rt.calibrate(batches)` measure each block's quantization error (kept on disk); False: gradients alone."""
    calibration_samples: int = 4
    """Batches the calibration runs."""
    quant_error_threshold: float = 0.05
    """The quantization error that scores 1 (the score is capped there)."""
    warmup_steps: int = 10
    """Steps before the first policy update."""
    history_window: int = 5
    """Steps of gradient statistics a score averages over."""
    update_interval_steps: int = 10
    """The policy updates the map every this many steps (mode 'dynamic')."""
    min_steps_between_switches: int = 20
    """A block switched by the policy is not switched again for this many steps."""
    force_bf16_blocks: list[int] = field(default_factory=list)
    """Blocks that stay bf16 in every mode."""
    force_int8_blocks: list[int] = field(default_factory=list)
    """Blocks that stay int8 in every mode."""
    log_decisions: bool = True
    """Log each switch the policy makes, with its score and reason."""
    telemetry_enabled: bool = True
    """Write the policy's decisions and scores to `telemetry_file`."""
    telemetry_file: str = "selective_precision_telemetry.jsonl"
    """The policy's JSONL telemetry (relative to the working directory)."""
    calibration_cache_dir: str | None = None
    """Where calibration results are cached (None = $STAGEHAND_CACHE_DIR/calibration)."""
    loss_spike_ratio: float = 0.1
    """Loss feedback (rt.observe_loss(loss)): a switch to fewer bytes followed within loss_feedback_steps by a mean
    loss above (1 + this) x the mean before it is reverted, the block kept bf16 for loss_feedback_block_steps."""
    loss_feedback_steps: int = 20
    """Steps after a switch to fewer bytes in which the loss is watched (see loss_spike_ratio)."""
    loss_feedback_block_steps: int = 100
    """Steps a block reverted by the loss feedback stays bf16."""
    fp8_policy_file: str | None = None
    """FP8: a measured policy file (`python -m torch_stagehand.runtime.selective.fp8_bench`); blocks the policy
    sends to fewer bytes take fp8 where every layer was measured faster than bf16 at fp8_tokens tokens."""
    fp8_tokens: int | None = None
    """The token count the FP8 policy file's measurements are read at (required with `fp8_policy_file`)."""
    fp8_emulate: bool = False
    """FP8 on a device without FP8 tensor cores (CPU, pre-sm_89) computes a dequantized emulation; off = refused."""
    granularity: str = "block"
    """'block': one precision per block (the seed); "layer": a block's attention and MLP are scored and switched
    apart (maps then hold by-role precisions such as "int8-mlp": attention bf16, MLP int8)."""

    @property
    def effective_mode(self) -> str:
        return "dynamic" if self.mode is None else self.mode

    def validate(self, prefix: str = "selective_precision") -> None:
        _check(self, f"{prefix}.", _PRECISION_RULES + (("ambiguous_default", _one_of(*precisions.names())),))
        if self.int8_threshold > self.bf16_threshold:
            raise ConfigError(f"{prefix}.int8_threshold: {self.int8_threshold} is above {prefix}.bf16_threshold "
                              f"{self.bf16_threshold}; the ambiguous zone would be empty")
        if self.fp8_policy_file is not None and self.fp8_tokens is None:
            raise ConfigError(f"{prefix}.fp8_tokens: must be set with {prefix}.fp8_policy_file "
                              "(the policy's rules are per token count)")
        both = set(self.force_bf16_blocks) & set(self.force_int8_blocks)
        if both:
            raise ConfigError(f"{prefix}.force_bf16_blocks and {prefix}.force_int8_blocks both name block(s) "
                              f"{sorted(both)}")


@dataclass
class Config:
    """Top of the tree: what `offload(..., config=Config(...))` takes."""

    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    """Budgets, transfer slots and the run-time rules (`ConductorConfig`)."""
    selective_precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """The selective-precision policy (`PrecisionConfig`)."""
    slots: int | None = None
    """Device slots for streamed blocks; None = prefetch_window + 1 (the plan's need)."""
    quantizer: str = "mse"
    """'mse' (per-row clipping search) or "absmax" for INT8 built from live weights."""
    pin_memory: bool = True
    """Pin host buffers when streaming to CUDA (False only for debugging)."""
    telemetry_file: str | None = None
    """Telemetry JSONL of what actually happened (bytes, stalls, phases); None = off."""
    require_slab_identity: bool = False
    """offload(slab=...): refuse a slab that records no identity of its source weights (older slabs, plain SquareQ
    ones) instead of loading it with a SlabIdentityWarning."""
    expandable_segments: bool = True
    """CUDA: turn on the caching allocator's expandable segments at offload (a fragmented cache fails units that
    fit), unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF configures it. False: leave the allocator alone."""
    freeze_gc_after_compile: bool = True
    """At offload's end and after a step that compiled units: gc.collect(), then gc.freeze(), so the collector stops
    walking the compile's millions of objects (collector.py); restore() unfreezes. False: leave it alone."""
    keep_full: str = "auto"
    """Where the full-precision master of a block that streams INT8 is kept: "pinned", "ram" (pageable), "file" (not
    in RAM: views of the model's safetensors file, offload(checkpoint=...)), or "auto" ("ram" while it fits the
    memory there is, else "file" when a checkpoint is given)."""
    int8_tier: str = "ram"
    """'disk': with offload(slab=...), INT8 blocks are read from the slab file at each fetch through a small pinned
    staging ring (host/disk_tier.py) instead of being held in RAM; "ram": held in RAM."""
    slab_reads: str = "auto"
    """offload(slab=...): who reads the INT8 rows. "process": a reader process, into shared memory (memfd) mapped
    here (offload's compiler preparation holds this GIL, which reader threads would wait for); "threads": threads
    here; "auto": the process where memfd_create exists and the node's ranks do not share the store, else threads."""
    slab_rows_behind: bool = True
    """The reader process's reads go on after offload returns (read_process.RowsBehind); the first INT8 fetch waits
    for the rest (the first step's capture and compile run meanwhile) and raises a layer that failed its check.
    False: offload returns with every row read (reader threads and a meta model's slab biases always do)."""
    routed_experts_max_tokens: int = 16
    """A mixture-of-experts eager no-grad forward of at most this many tokens (generation) reads each layer directly
    and each expert stack only for the experts its router picked (eager_path.py); 0: whole blocks always."""
    expert_cache_bytes: int | str = "auto"
    """The device cache of routed experts between generation steps (experts/cache.py): bytes or a size ("2GiB"), or
    "auto": what the VRAM budget leaves at the first routed read, less a fifth (nothing beyond its floor, two
    tokens' picks twice, without a budget)."""
    node_shared_store: str = "auto"
    """Under torch.distributed: the ranks of one node share one host store (host/node_store.py): "auto" (when more
    than one rank runs on the node and they can map each other's memory), "on" (refuse where not), "off"."""
    node_timeout_s: float = 600.0
    """Seconds a rank waits for the other ranks of its node during offload (a rank that died is reported then)."""

    def validate(self) -> "Config":
        self.conductor.validate("conductor")
        self.selective_precision.validate("selective_precision")
        _check(self, "", _CONFIG_RULES)
        h2d_slots = self.conductor.h2d_slots
        if self.slots is not None and h2d_slots not in (_DEFAULT_H2D_SLOTS, self.slots):
            raise ConfigError(f"conductor.h2d_slots: {h2d_slots} disagrees with slots: {self.slots}; both set "
                              "the device slots (slots wins when set): set one of them")
        slots_field = "slots" if self.slots is not None else "conductor.h2d_slots"
        if self.slot_count < self.conductor.prefetch_window + 1:
            raise ConfigError(f"{slots_field}: {self.slot_count} cannot hold the computing block plus "
                              f"conductor.prefetch_window={self.conductor.prefetch_window} prefetched ones")
        shadow = self.conductor.telemetry_file
        if self.telemetry_file is not None and shadow is not None and shadow != self.telemetry_file:
            raise ConfigError(
                f"conductor.telemetry_file: {shadow!r} disagrees with telemetry_file: {self.telemetry_file!r}; "
                "both name the telemetry JSONL (telemetry_file wins when set): set one of them")
        if self.expert_cache_bytes != "auto" and self.expert_cache_bytes != 0:
            from torch_stagehand.runtime.conductor.costs import BudgetError, parse_bytes

            try:
                parse_bytes(self.expert_cache_bytes, "expert_cache_bytes")
            except BudgetError as e:
                raise ConfigError(f"{e}; or 'auto'") from None
        return self

    @property
    def slot_count(self) -> int:
        """The device slots the runtime allocates (the module docstring says which field wins)."""
        if self.slots is not None:
            return self.slots
        if self.conductor.h2d_slots != _DEFAULT_H2D_SLOTS:
            return self.conductor.h2d_slots
        return self.conductor.prefetch_window + 1

    @property
    def telemetry_path(self) -> str | None:
        """Where telemetry goes: `telemetry_file`, else `conductor.telemetry_file`; None = off."""
        return self.telemetry_file if self.telemetry_file is not None else self.conductor.telemetry_file

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        """Build from this tree's layout or the seeds' training-config layout."""
        if not isinstance(data, dict):
            raise ConfigError(f"config: expected a JSON object, got {type(data).__name__}")
        if "memory" in data:  # the seeds' layout
            stagehand = data["memory"].get("stagehand", {}) if isinstance(data["memory"], dict) else None
            if not isinstance(stagehand, dict):
                raise ConfigError("memory.stagehand: expected a JSON object")
            data = dict(stagehand)
            if "conductor_config" in data:
                data["conductor"] = data.pop("conductor_config")
        return _build(cls, data, prefix="").validate()

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> "Config":
        text = str(path_or_text)
        if os.path.exists(text):
            with open(text) as f:
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{text}: not valid JSON ({e})") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"config: neither a file nor valid JSON ({e})") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(f"{path}: unknown field (known: {', '.join(sorted(known))})")
        nested = _NESTED.get((cls, key))
        if nested is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a JSON object, got {type(value).__name__}")
            value = _build(nested, value, prefix=f"{path}.")
        kwargs[key] = value
    return cls(**kwargs)


_NESTED = {(Config, "conductor"): ConductorConfig, (Config, "selective_precision"): PrecisionConfig}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _one_of(*choices) -> tuple:
    listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
    return (lambda value: value in choices), f"must be {listed}"


def _optional(rule: tuple) -> tuple:
    return (lambda value: value is None or rule[0](value)), rule[1]


def _check(obj: Any, prefix: str, rules) -> None:
    """Each rule: (space-separated field names, (a test of the value, what the error says it must be))."""
    for names, (ok, must) in rules:
        for name in names.split():
            value = getattr(obj, name)
            if not ok(value):
                raise ConfigError(f"{prefix}{name}: {must}, got {value!r}")


_POSITIVE_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1), "must be a positive integer"
_NON_NEGATIVE_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0), \
    "must be a non-negative integer"
_UNIT = (lambda v: _is_number(v) and 0.0 <= v <= 1.0), "must be a number in [0, 1]"
_BLOCKS = (lambda v: isinstance(v, list) and all(isinstance(b, int) and b >= 0 for b in v)), \
    "must be a list of block indices"
_CONDUCTOR_RULES = (
    ("h2d_slots d2h_slots contention_checks telemetry_interval_steps", _POSITIVE_INT),
    ("prefetch_window", _NON_NEGATIVE_INT), ("backward_pressure_threshold", _UNIT),
    ("vram_soft_cap_mb vram_hard_cap_mb pinned_budget_mb",
     _optional(((lambda v: _is_number(v) and v > 0), "must be a positive number of MB or null"))))
_PRECISION_RULES = (
    ("mode", _optional(_one_of("off", "static", "dynamic"))),
    ("bf16_threshold int8_threshold hysteresis_margin grad_weight error_weight", _UNIT),
    ("grad_sensitivity_threshold quant_error_threshold loss_spike_ratio",
     ((lambda v: _is_number(v) and v > 0), "must be a positive number")),
    ("calibration_samples history_window update_interval_steps loss_feedback_steps loss_feedback_block_steps",
     _POSITIVE_INT),
    ("warmup_steps min_steps_between_switches", _NON_NEGATIVE_INT),
    ("force_bf16_blocks force_int8_blocks", _BLOCKS),
    ("granularity", _one_of("block", "layer")), ("fp8_tokens", _optional(_POSITIVE_INT)))
_CONFIG_RULES = (
    ("slots", _optional(_POSITIVE_INT)), ("quantizer", _one_of("mse", "absmax")),
    ("keep_full", _one_of("auto", "pinned", "ram", "file")), ("int8_tier", _one_of("ram", "disk")),
    ("slab_reads", _one_of("auto", "process", "threads")), ("node_shared_store", _one_of("auto", "on", "off")),
    ("slab_rows_behind", ((lambda v: isinstance(v, bool)), "must be True or False")),
    ("routed_experts_max_tokens", ((lambda v: isinstance(v, int) and v >= 0), "must be an int >= 0")),
    ("node_timeout_s", ((lambda v: _is_number(v) and v > 0), "must be a positive number of seconds")),
    ("expandable_segments freeze_gc_after_compile require_slab_identity",
     ((lambda v: isinstance(v, bool)), "must be true or false")))
