"""offload() freezes what exists at its end; after a step that compiled units the runtime collects once and
freezes what is left (gc.freeze); later steps that compile nothing freeze nothing; restore() unfreezes; the
config can leave the collector alone."""

from __future__ import annotations

import gc

import pytest
import torch

import torch_stagehand as stagehand

from _helpers import toy


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def _run(config=None, steps: int = 3, after_offload=None):
    model, x = toy(n=3)
    for block in model.blocks:
        block.norm.requires_grad_(True)  # something to train (the streamed weights are frozen)
    rt = stagehand.offload(model, device="cpu", config=config)
    if after_offload is not None:
        after_offload(rt)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    rt.attach(optimizer)
    counts = []
    for _ in range(steps):
        compiled(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        counts.append(gc.get_freeze_count())
    return rt, counts


def test_the_step_that_compiled_freezes_the_heap_and_restore_unfreezes_it():
    at_offload = {}
    rt, counts = _run(after_offload=lambda rt: at_offload.update(count=gc.get_freeze_count(),
                                                                 freezes=list(rt.stats()["gc_freezes"])))
    # offload froze the heap as it ended: the libraries, the model and the host store are out of the walks
    [before] = at_offload["freezes"]
    assert before["at"] == "offload" and before["frozen_objects"] >= at_offload["count"] > 10_000
    offload, freeze = rt.stats()["gc_freezes"]  # the first step compiled every unit; the others compiled none
    assert offload == before
    assert freeze["at"] == "step" and freeze["step"] == 0
    # The compile's objects joined the frozen ones.
    assert freeze["frozen_objects"] > offload["frozen_objects"]
    # Frozen objects freed by their reference counts leave the count: it only falls, nothing frozen since.
    assert freeze["frozen_objects"] >= counts[0] >= counts[1] >= counts[2] > 10_000
    rt.restore()
    assert gc.get_freeze_count() == 0


def test_a_config_that_leaves_the_collector_alone_freezes_nothing():
    rt, counts = _run(stagehand.Config(freeze_gc_after_compile=False), steps=2)
    assert counts == [0, 0] and rt.stats()["gc_freezes"] == []
    with pytest.raises(stagehand.ConfigError, match="freeze_gc_after_compile: must be true or false"):
        stagehand.Config(freeze_gc_after_compile=1).validate()


def test_restore_in_the_middle_of_a_step_that_compiled_leaves_nothing_frozen():
    """close() ends the open step after removing its hooks: a step that compiled (no optimizer attached, so
    it is still open) must not freeze the heap after the unfreeze."""
    model, x = toy(n=3)
    rt = stagehand.offload(model, device="cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    with torch.no_grad():
        compiled(x)
    assert rt.phases.phase.value == "forward"
    rt.restore()
    assert gc.get_freeze_count() == 0
