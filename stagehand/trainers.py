"""The trainers people already use: Hugging Face `Trainer` and `accelerate`, on a model offloaded first.

    import torch_stagehand as stagehand
    from torch_stagehand.trainers import StagehandTrainer

    rt = stagehand.offload(model)                           # peft first, then offload, then the Trainer
    args = TrainingArguments(..., torch_compile=True, torch_compile_backend="stagehand")
    trainer = StagehandTrainer(model=model, args=args, train_dataset=ds)   # a Trainer in every other way
    trainer.train()                                         # resume_from_checkpoint=... works too

Why a subclass: the stock `Trainer` hands `torch_compile_backend` to accelerate's `TorchDynamoPlugin`, whose
backend is an enum of accelerate's own names. With the stock `Trainer` (your own `torch.compile`), add
`StagehandCallback()` to its callbacks. accelerate: `Accelerator(dynamo_plugin=stagehand_dynamo_plugin())` compiles
prepared models with the backend; `rt.attach(optimizer)` takes the prepared (wrapped) optimizer.

This module imports transformers and accelerate; `import torch_stagehand` does not load it.
"""

from __future__ import annotations

from typing import Any

from accelerate.utils import TorchDynamoPlugin
from transformers import Trainer, TrainerCallback

from torch_stagehand.api import runtime_of
from torch_stagehand.environment import env, set_env

BACKEND = "stagehand"


class StagehandDynamoPlugin(TorchDynamoPlugin):
    """accelerate's dynamo plugin for `backend="stagehand"`: the enum field holds INDUCTOR (so accelerate compiles
    at `prepare`); `to_kwargs` is what `torch.compile` gets."""

    def __init__(self, options: dict[str, Any] | None = None):
        super().__init__(backend="inductor")
        self.stagehand_options = dict(options or {})

    def to_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"backend": BACKEND}
        if self.stagehand_options:
            kwargs["options"] = dict(self.stagehand_options)
        return kwargs

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "backend": BACKEND, "options": dict(self.stagehand_options)}


def stagehand_dynamo_plugin(options: dict[str, Any] | None = None) -> StagehandDynamoPlugin:
    """For `Accelerator(dynamo_plugin=...)`: `prepare(model)` compiles it with the stagehand backend."""
    return StagehandDynamoPlugin(options)


class StagehandCallback(TrainerCallback):
    """Attaches the Trainer's optimizer to the offloaded model's runtime when training begins: without it the
    runtime sees no step ends (no telemetry, `stats()["steps"]`, first-step report). Attaching again is harmless."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is not None and optimizer is not None:
            runtime_of(model).attach(optimizer)


class StagehandTrainer(Trainer):
    """A `Trainer` that accepts `TrainingArguments(torch_compile_backend="stagehand")` and adds `StagehandCallback`.

    stagehand_options: the backend's options (`{"inner": "eager"}`: no Inductor, for a CPU or for debugging;
    `{"recompute": "blocks"}`). The model must be offloaded before it is passed in.
    """

    def __init__(self, *args, stagehand_options: dict[str, Any] | None = None, **kwargs):
        self.stagehand_options = dict(stagehand_options or {})
        callbacks = list(kwargs.pop("callbacks", None) or [])
        if not any(isinstance(c, StagehandCallback) for c in callbacks):
            callbacks.append(StagehandCallback())
        super().__init__(*args, callbacks=callbacks, **kwargs)
        runtime_of(self.model)  # a clear error now if the model was not offloaded

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        if self.args.torch_compile_backend != BACKEND:
            return super()._build_accelerator_args(**kwargs)
        # TrainingArguments exported the name for old accelerate versions; accelerate's enum refuses it.
        if env("ACCELERATE_DYNAMO_BACKEND") == BACKEND:
            set_env("ACCELERATE_DYNAMO_BACKEND", None)
        self.args.torch_compile_backend = "no"
        try:
            built = super()._build_accelerator_args(**kwargs)
        finally:
            self.args.torch_compile_backend = BACKEND
        built["dynamo_plugin"] = StagehandDynamoPlugin(self.stagehand_options)
        return built
