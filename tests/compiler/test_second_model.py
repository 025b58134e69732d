"""Each offload gets its own compiled graph, precision map and plan, in whichever order models come.

A notebook or a sweep offloads and compiles one model, then another of the same architecture (other weights,
another precision, budget or depth), or restores the first and offloads it again, and compiles again without
`torch._dynamo.reset()`. Dynamo's cache must not hand the new offload the old graph: the new model computes in
its own precision (its loss is that of its own reference, not of the first model's precision) and its own
units are compiled.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import torch_stagehand as stagehand

from _helpers import int8_reference


def _qwen(seed: int, layers: int = 3, checkpointing: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _reference_loss(model, precision: str) -> float:
    ref = int8_reference(model, precision) if precision == "int8" else copy.deepcopy(model)
    with torch.no_grad():
        return float(ref(IDS, labels=IDS).loss)


def _compiled_loss(model, rt, train: bool) -> float:
    compiled = torch.compile(model, backend="stagehand", options={"inner": "eager"})
    loss = compiled(IDS, labels=IDS).loss
    if train:
        loss.backward()
        # another runtime's schedule would fetch this one's blocks synchronously (seen: 7 a step)
        assert rt.stats()["sync_fetches"] == 0
    return float(loss.detach())


def _check(model, precision: str, train: bool = False, **offload_kw) -> None:
    expected = _reference_loss(model, precision)
    rt = stagehand.offload(model, device="cpu", precision=precision, verbose=False, **offload_kw)
    try:
        got = _compiled_loss(model, rt, train)
        assert rt.stats()["compiled_units"] > 0, "this offload ran a graph compiled for another runtime"
        assert got == pytest.approx(expected, abs=2e-3), f"{precision}: {got} against its reference {expected}"
    finally:
        rt.restore()


@pytest.mark.parametrize("order", [("bf16", "int8"), ("int8", "bf16")], ids=["bf16 then int8", "int8 then bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_a_second_model_gets_its_own_graph(order, checkpointing):
    torch._dynamo.reset()  # once, before the first model: the second must not need it
    first, second = _qwen(0, checkpointing=checkpointing), _qwen(1, checkpointing=checkpointing)
    _check(first, order[0], train=checkpointing)
    _check(second, order[1], train=checkpointing)


@pytest.mark.parametrize("order", [("bf16", "int8"), ("int8", "bf16")], ids=["bf16 then int8", "int8 then bf16"])
def test_the_same_model_offloaded_again_with_another_precision(order):
    torch._dynamo.reset()
    model = _qwen(2)
    _check(model, order[0])
    _check(model, order[1])  # restored by _check, offloaded again


def test_another_depth_and_a_mixed_map_after_a_first_model():
    torch._dynamo.reset()
    _check(_qwen(3, layers=2), "int8")
    model = _qwen(4, layers=4)
    mixed = {0: "int8", 1: "bf16", 2: "int8", 3: "bf16"}
    expected = _reference_loss(int8_reference(model, mixed), "bf16")
    rt = stagehand.offload(model, device="cpu", precision=mixed, verbose=False)
    try:
        assert _compiled_loss(model, rt, train=False) == pytest.approx(expected, abs=2e-3)
        assert rt.stats()["precision_counts"] == {"int8": 2, "bf16": 2}
    finally:
        rt.restore()


def test_compile_blocks_gives_each_offload_its_own_units():
    torch._dynamo.reset()
    for seed, precision in ((5, "bf16"), (6, "int8")):
        model = _qwen(seed)
        expected = _reference_loss(model, precision)
        rt = stagehand.offload(model, device="cpu", precision=precision, verbose=False)
        try:
            stagehand.compile_blocks(model, options={"inner": "eager"})
            with torch.no_grad():
                got = float(model(IDS, labels=IDS).loss)
            assert rt.stats()["compiled_units"] > 0
            assert got == pytest.approx(expected, abs=2e-3)
        finally:
            rt.restore()
