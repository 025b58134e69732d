"""Out of device memory in the middle of a step: the runtime re-plans and runs the block again.

The allocator's failure is injected where a unit meets its block: the block's `wait` (the op
that takes its weights, inside the compiled unit) raises `torch.OutOfMemoryError` once, as
the device would when something else took the memory. A run with the fault must give the
numbers of an undisturbed run, step after step, with the optimizer stepping on whole
gradients only.
"""

from __future__ import annotations


import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.runtime.device import allocator
from torch_stagehand.runtime.conductor import oom_recovery
from torch_stagehand.runtime.conductor.oom_recovery import OutOfMemoryWarning

from _helpers import block_bytes_by_precision, close, toy

N = 6


def _model():
    model, x = toy(n=N)
    for block in model.blocks:
        block.norm.requires_grad_(True)
    return model, x


def _offloaded(budget_blocks: int | None = 5, recompute: str | None = None):
    model, x = _model()
    block = block_bytes_by_precision(toy(n=N)[0])["bf16"][0]
    rt = stagehand.offload(model, device="cpu", vram_budget=None if budget_blocks is None else budget_blocks * block)
    torch._dynamo.reset()
    options = {"inner": "eager", **({"recompute": recompute} if recompute else {})}
    compiled = torch.compile(model, backend="stagehand", options=options)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    rt.attach(optimizer)
    return rt, model, compiled, optimizer, x


def _train(compiled, optimizer, x, steps: int):
    """Steps of a plain loop; each step's loss and the parameters after the last."""
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(x).float().square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _fail_once(rt, block: int, kind: str, at_call: int = 1):
    """The `at_call`-th wait of `block` of this kind ("forward", "recompute", "backward") runs out of memory."""
    real, calls = rt.op_wait, {"n": 0}

    def op_wait(b, precision_code, nbytes, backward):
        seen = "backward" if backward else "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
        if b == block and seen == kind:
            calls["n"] += 1
            if calls["n"] == at_call:
                if backward:  # the block's backward took its slot, then its first buffer did not fit
                    real(b, precision_code, nbytes, backward)
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected in the {kind} of block {b})")
        return real(b, precision_code, nbytes, backward)

    rt.op_wait = op_wait
    return calls


def _allocator_count(monkeypatch) -> dict:
    """The CUDA allocator's count of refused allocations, played by the test: a test adds one per failure."""
    ooms = {"n": 0}
    monkeypatch.setattr(oom_recovery, "allocator_ooms", lambda device: ooms["n"])
    return ooms


def _fail_the_losss_backward(compiled, x, ooms: dict) -> None:
    """A step whose loss's own backward (a logits buffer, before any block's op) runs out of memory."""
    out = compiled(x)

    def refuse(grad):
        ooms["n"] += 1
        raise torch.OutOfMemoryError("CUDA out of memory (injected in the loss's backward)")

    out.register_hook(refuse)
    with pytest.raises(torch.OutOfMemoryError, match="loss's backward"):
        out.float().square().mean().backward()


def _reference(steps: int, **kwargs):
    rt, model, compiled, optimizer, x = _offloaded(**kwargs)
    return _train(compiled, optimizer, x, steps), _params(model), rt


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    assert all(close(a[k], b[k], 0) for k in a), [k for k in a if not close(a[k], b[k], 0)]


def test_out_of_memory_in_a_blocks_forward_replans_and_runs_the_block_again_with_the_same_numbers():
    ref_losses, ref_params, ref_rt = _reference(3)
    rt, model, compiled, optimizer, x = _offloaded()
    before = rt.plan
    calls = _fail_once(rt, block=3, kind="forward", at_call=2)  # in the second step's forward
    with pytest.warns(OutOfMemoryWarning, match=r"forward of block 3 .* at step 1; re-planned .* ran it again"):
        losses = _train(compiled, optimizer, x, 3)
    assert calls["n"] >= 2
    assert losses == ref_losses  # every step ran whole, none twice: the optimizer stepped three times
    _same(_params(model), ref_params)
    [record] = rt.stats()["oom_recoveries"]
    assert record["step"] == 1 and record["action"] == "ran it again" and "injected" in record["error"]
    # The new budget is smaller than the one the plan had: fewer resident blocks, no more device bytes.
    assert rt.plan_driver.budget.limit < before.budget.limit
    assert len(rt.plan.resident) < len(before.resident)
    assert rt.stats()["streamed_device_bytes"] <= rt.plan_driver.budget.limit
    assert ref_rt.stats()["oom_recoveries"] == []


def test_a_run_without_a_budget_gets_one_after_running_out_of_memory():
    ref_losses, ref_params, _ = _reference(2, budget_blocks=None)
    rt, model, compiled, optimizer, x = _offloaded(budget_blocks=None)
    assert rt.plan.kind == "fixed"
    _fail_once(rt, block=0, kind="forward")
    with pytest.warns(OutOfMemoryWarning, match="budget no cap ->"):
        losses = _train(compiled, optimizer, x, 2)
    assert losses == ref_losses
    _same(_params(model), ref_params)
    assert rt.plan_driver.planning and rt.plan.kind == "planned"


def test_out_of_memory_in_a_recomputed_backward_runs_the_recompute_again():
    ref_losses, ref_params, _ = _reference(2, recompute="blocks")
    rt, model, compiled, optimizer, x = _offloaded(recompute="blocks")
    _fail_once(rt, block=2, kind="recompute")
    with pytest.warns(OutOfMemoryWarning, match="recomputed backward of block 2"):
        losses = _train(compiled, optimizer, x, 2)
    assert losses == ref_losses
    _same(_params(model), ref_params)
    assert [r["action"] for r in rt.stats()["oom_recoveries"]] == ["ran it again"]


def test_out_of_memory_in_a_saved_activation_backward_raises_without_a_step_and_the_next_forward_replans(monkeypatch):
    ref_losses, ref_params, _ = _reference(2)
    rt, model, compiled, optimizer, x = _offloaded()
    ooms = _allocator_count(monkeypatch)
    _fail_once(rt, block=4, kind="backward")
    start = _params(model)
    optimizer.zero_grad(set_to_none=True)
    loss = compiled(x).float().square().mean()
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        loss.backward()
    ooms["n"] += 1  # what the CUDA allocator counts when it refuses an allocation
    _same(_params(model), start)  # the optimizer never stepped on the partial gradients
    assert any(s.holds for s in rt.pool.all_slots())  # the failed backward left its block held
    limit = rt.plan_driver.budget.limit
    with pytest.warns(OutOfMemoryWarning, match=r"backward of block 4 .* must be run again"):
        losses = _train(compiled, optimizer, x, 2)  # the loop runs the step again
    assert losses == ref_losses
    _same(_params(model), ref_params)
    assert rt.plan_driver.budget.limit < limit
    assert not any(s.holds for s in rt.pool.all_slots())


def test_a_backward_that_raised_something_else_releases_its_slots_and_keeps_the_plan():
    rt, model, compiled, optimizer, x = _offloaded()
    real = rt.op_wait

    def op_wait(b, precision_code, nbytes, backward):
        slot = real(b, precision_code, nbytes, backward)
        if backward and b == 4:
            raise ValueError("not memory")
        return slot

    rt.op_wait = op_wait
    with pytest.raises(ValueError):
        compiled(x).float().square().mean().backward()
    rt.op_wait = real
    budget = rt.plan_driver.budget
    with pytest.warns(OutOfMemoryWarning, match="did not finish"):
        _train(compiled, optimizer, x, 1)
    assert rt.plan_driver.budget is budget and rt.stats()["oom_recoveries"] == []


def test_recovery_gives_up_after_max_tries_and_for_a_backward_that_sends_gradients_home():
    rt, model, compiled, optimizer, x = _offloaded()
    real = rt.op_wait

    def always(b, precision_code, nbytes, backward):
        if b == 1 and not backward:
            raise torch.OutOfMemoryError("CUDA out of memory (injected every time)")
        return real(b, precision_code, nbytes, backward)

    rt.op_wait = always
    with pytest.warns(OutOfMemoryWarning), pytest.raises(torch.OutOfMemoryError, match="every time"):
        compiled(x)
    records = rt.stats()["oom_recoveries"]
    assert [r["action"] for r in records] == ["ran it again"] * oom_recovery.MAX_TRIES + ["raised"]
    assert "times in this step" in records[-1]["why"]
    assert not any(s.holds for s in rt.pool.all_slots())
    refused = rt.oom.recover("the recomputed backward of block 0", RuntimeError("x"), trainable_backward=True)
    assert refused is False and "twice" in rt.stats()["oom_recoveries"][-1]["why"]


def test_the_budget_comes_back_when_the_device_has_room_again(monkeypatch, patch_config):
    ref_losses, ref_params, ref_rt = _reference(6)
    rt, model, compiled, optimizer, x = _offloaded()
    given, resident = rt.plan_driver.budget, len(rt.plan.resident)
    patch_config(oom_regrow_every=2)
    _fail_once(rt, block=3, kind="forward")
    with pytest.warns(OutOfMemoryWarning):
        losses = _train(compiled, optimizer, x, 2)  # step 0 recovers; at step 1's end the room is unknown (CPU)
    assert rt.plan_driver.budget.limit < given.limit and len(rt.plan.resident) < resident
    room = 10 * given.limit + 2 * oom_recovery.MIN_MARGIN
    monkeypatch.setattr(oom_recovery, "device_room", lambda device: room)  # the other job left
    losses += _train(compiled, optimizer, x, 4)
    assert rt.plan_driver.budget == given and len(rt.plan.resident) == resident
    assert rt.stats()["oom_recoveries"][-1]["action"] == "the user's budget is back"
    assert losses == ref_losses  # the same steps, whatever the plan
    _same(_params(model), ref_params)
    records = len(rt.stats()["oom_recoveries"])
    _train(compiled, optimizer, x, 4)
    assert len(rt.stats()["oom_recoveries"]) == records  # back at the user's budget: no more looking


def _recovered_once(patch_config):
    """An offloaded model whose first step recovered from out of memory in block 3; the room read every step."""
    rt, model, compiled, optimizer, x = _offloaded()
    patch_config(oom_regrow_every=1)
    _fail_once(rt, block=3, kind="forward")
    with pytest.warns(OutOfMemoryWarning):
        _train(compiled, optimizer, x, 1)
    return rt, model, compiled, optimizer, x


def test_a_room_grown_by_5_percent_leaves_the_budget_and_by_20_raises_it_to_the_room(monkeypatch, patch_config):
    rt, model, compiled, optimizer, x = _recovered_once(patch_config)
    shrunk = rt.plan_driver.budget.limit
    margin = oom_recovery.MIN_MARGIN
    monkeypatch.setattr(oom_recovery, "device_room", lambda device: int(shrunk * 1.05) + margin)  # +5%: not enough
    _train(compiled, optimizer, x, 2)
    assert rt.plan_driver.budget.limit == shrunk
    monkeypatch.setattr(oom_recovery, "device_room", lambda device: int(shrunk * 1.2) + margin)  # +20%
    _train(compiled, optimizer, x, 1)
    assert shrunk < rt.plan_driver.budget.limit == int(shrunk * 1.2)  # still under the user's: raised with the room
    assert rt.stats()["oom_recoveries"][-1]["action"] == "budget raised with the room"


def test_a_unit_failing_again_is_planned_for_without_the_fragmented_cache(monkeypatch):
    rt, model, compiled, optimizer, x = _offloaded()
    ceiling = min(rt.plan_driver.budget.limit, rt.plan.predicted_peak_bytes)
    margin = oom_recovery.MIN_MARGIN
    monkeypatch.setattr(oom_recovery, "device_room", lambda device: int(0.9 * ceiling) + margin)
    monkeypatch.setattr(oom_recovery, "fragmented_bytes", lambda device: int(0.2 * ceiling))
    _fail_once(rt, block=3, kind="forward", at_call=1)
    _fail_once(rt, block=3, kind="forward", at_call=2)  # the run again fails too (the same step)
    with pytest.warns(OutOfMemoryWarning):
        compiled(x)
    first, second = rt.stats()["oom_recoveries"]
    assert first["budget_after"].startswith(f"soft {oom_recovery.human(int(0.9 * ceiling))}")
    assert second["budget_after"].startswith(f"soft {oom_recovery.human(int(0.7 * ceiling))}")
    assert rt.plan_driver.budget.limit == int(0.9 * ceiling) + margin - int(0.2 * ceiling) - margin


def test_a_budget_the_user_sets_after_a_recovery_stands(monkeypatch, patch_config):
    rt, model, compiled, optimizer, x = _recovered_once(patch_config)
    mine = rt.plan_driver.budget.limit - 1024
    rt.replan(vram_budget=mine)
    room = 10 * mine + 2 * oom_recovery.MIN_MARGIN
    monkeypatch.setattr(oom_recovery, "device_room", lambda device: room)
    _train(compiled, optimizer, x, 2)
    assert rt.plan_driver.budget.limit == mine and rt.oom._user_budget is None


def test_the_optimizer_is_refused_after_a_backward_that_raised_and_the_next_forward_drops_its_gradients(monkeypatch):
    """A loop that catches the error and steps anyway is refused; one that goes on without zeroing the
    gradients gets them dropped at the next forward: neither applies a partial gradient."""
    ref_losses, ref_params, _ = _reference(2)
    rt, model, compiled, optimizer, x = _offloaded()
    ooms = _allocator_count(monkeypatch)
    _fail_once(rt, block=4, kind="backward")
    start = _params(model)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        compiled(x).float().square().mean().backward()
    ooms["n"] += 1
    assert any(p.grad is not None for p in model.parameters())  # the blocks after 4 left their gradients
    with pytest.raises(stagehand.BackwardIncompleteError, match="did not finish .* partial"):
        optimizer.step()
    _same(_params(model), start)
    limit = rt.plan_driver.budget.limit
    losses = []
    dropped = r"must be run again .* partial gradients of \d+ parameters were dropped"
    with pytest.warns(OutOfMemoryWarning, match=dropped):
        for _ in range(2):  # zero_grad after the step: the failed backward's gradients reach the next forward
            loss = compiled(x).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    assert losses == ref_losses
    _same(_params(model), ref_params)
    assert rt.plan_driver.budget.limit < limit  # re-planned for the refusal no recovery handled


def test_offload_turns_on_expandable_segments_unless_the_environment_configures_the_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for var in allocator.ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    assert allocator.use_expandable_segments(torch.device("cpu")) == "not CUDA" and calls == []
    assert "expandable_segments:True" in allocator.use_expandable_segments(torch.device("cuda", 0))
    assert calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    assert "set by the user" in allocator.use_expandable_segments(torch.device("cuda", 0))
    assert calls == ["expandable_segments:True"]
    with pytest.raises(stagehand.ConfigError, match="expandable_segments: must be true or false"):
        stagehand.Config(expandable_segments="yes").validate()


def test_a_plan_that_did_not_fit_when_applied_counts_as_handled_and_a_pending_refusal_stays_pending(monkeypatch):
    """The re-plan at a forward may itself be refused by the allocator (its first application did not fit,
    the budget shrank): handled there. A refusal from before (the loss's backward raised) stays pending
    through a plan the user applies before the next forward, which then finds it and re-plans."""
    ref_losses, ref_params, _ = _reference(2)
    rt, model, compiled, optimizer, x = _offloaded()
    ooms = _allocator_count(monkeypatch)
    real_reconfigure = rt.pool.reconfigure

    def reconfigure(*args, **kwargs):
        ooms["n"] += 1  # the allocator refused a try of this application; the driver handled it
        return real_reconfigure(*args, **kwargs)

    monkeypatch.setattr(rt.pool, "reconfigure", reconfigure)
    _fail_the_losss_backward(compiled, x, ooms)
    rt.replan(vram_budget=rt.plan_driver.budget.limit)  # a plan applied before the next forward
    step, limit = rt.phases.step, rt.plan_driver.budget.limit
    with pytest.warns(OutOfMemoryWarning, match="the last backward .* must be run again"):
        losses = _train(compiled, optimizer, x, 2)  # its own applications' refusals: none refuses the optimizer
    assert losses == ref_losses
    _same(_params(model), ref_params)
    assert rt.phases.step == step + 3 and rt.plan_driver.budget.limit < limit


def test_a_backward_that_raised_before_its_first_block_is_found_by_the_next_forward(monkeypatch):
    """The loss's own backward (a logits buffer) runs before any block's op: no block is held and no block
    watched it. The optimizer straight after the forward is refused, and the next forward (its first block
    again) ends the failed step, re-plans and runs as an undisturbed step would."""
    ref_losses, ref_params, _ = _reference(2)
    rt, model, compiled, optimizer, x = _offloaded()
    ooms = _allocator_count(monkeypatch)
    _fail_the_losss_backward(compiled, x, ooms)
    with pytest.raises(stagehand.BackwardIncompleteError, match="after the forward"):
        optimizer.step()
    limit, step = rt.plan_driver.budget.limit, rt.phases.step
    with pytest.warns(OutOfMemoryWarning, match="the last backward .* must be run again"):
        losses = _train(compiled, optimizer, x, 2)
    assert losses == ref_losses
    _same(_params(model), ref_params)
    assert rt.plan_driver.budget.limit < limit
    assert rt.phases.step == step + 3  # the failed step ended when the next forward began


def test_a_loop_that_skips_the_optimizer_after_the_losss_backward_raised_is_found_at_the_first_block(monkeypatch):
    """No optimizer call after the failure: the next forward's first block, with an allocator refusal that
    nothing handled since the last forward began, ends the failed step there and re-plans."""
    ref_losses, ref_params, _ = _reference(2)
    rt, model, compiled, optimizer, x = _offloaded()
    ooms = _allocator_count(monkeypatch)
    _fail_the_losss_backward(compiled, x, ooms)
    step, limit = rt.phases.step, rt.plan_driver.budget.limit
    with pytest.warns(OutOfMemoryWarning, match="the last backward .* must be run again"):
        losses = _train(compiled, optimizer, x, 2)
    assert losses == ref_losses
    _same(_params(model), ref_params)
    assert rt.phases.step == step + 3 and rt.plan_driver.budget.limit < limit


def test_two_forwards_in_one_step_stay_one_step():
    """A step that runs the model twice before its backward (chosen and rejected, a reference pass) is one
    step: no refusal, nothing re-planned, no gradient dropped."""
    rt, model, compiled, optimizer, x = _offloaded()
    for _ in range(3):
        a, b = compiled(x), compiled(2 * x)
        (a - b).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert rt.phases.step == 3 and rt.stats()["oom_recoveries"] == []


def test_the_fragmentation_note_names_the_way_out_that_is_left(monkeypatch):
    """Above a quarter of the room in pieces, a refusal names expandable segments, or, when they are on
    already, what is left to do."""
    rt, *_ = _offloaded()
    monkeypatch.setattr(oom_recovery, "device_room", lambda device: 8 * 2**30)
    monkeypatch.setattr(oom_recovery, "fragmented_bytes", lambda device: 3 * 2**30)
    rt.oom.allocator = "left as it is"
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in rt.oom._fragmentation_note()
    rt.oom.allocator = "expandable_segments:True (Config.expandable_segments)"
    note = rt.oom._fragmentation_note()
    assert "expandable segments are on" in note and "PYTORCH_CUDA_ALLOC_CONF" not in note
    monkeypatch.setattr(oom_recovery, "fragmented_bytes", lambda device: 2**30)
    assert rt.oom._fragmentation_note() == ""


def test_a_refusal_someone_caught_in_a_finished_backward_keeps_the_accumulated_gradients(monkeypatch):
    """Gradient accumulation: an allocator refusal caught elsewhere during a backward that reached its end
    (a library's workspace fallback) is not a failed step: the next micro-batch adds to the gradients."""
    import warnings

    rt, model, compiled, optimizer, x = _offloaded()
    ooms = _allocator_count(monkeypatch)
    out = compiled(x)
    out.register_hook(lambda grad: ooms.update(n=ooms["n"] + 1))  # counted, caught, the backward goes on
    out.float().square().mean().backward()
    first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfMemoryWarning)
        compiled(x).float().square().mean().backward()  # the second micro-batch
    summed = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert first and summed.keys() == first.keys()
    assert all(torch.allclose(summed[n], 2 * first[n]) for n in first)
    assert rt.stats()["oom_recoveries"] == []


def test_a_forward_after_a_backward_without_an_optimizer_keeps_its_first_block():
    """Accumulation (no optimizer between micro-steps): the forward that follows a backward starts the next
    step, and the block it waits for first stays its first block (the one a rerun is recognised at)."""
    rt, model, compiled, optimizer, x = _offloaded()
    for micro_step in range(3):
        compiled(x).float().square().mean().backward()
        assert rt.phases.step == micro_step  # each micro-step is a step to the tracker
        assert rt.oom._first_block == 0 and rt.oom._first_step == rt.phases.step


def test_a_step_whose_forward_gave_up_is_ended_by_the_loops_rerun_and_re_planned():
    """A unit refused after three recoveries raises out of the forward; the loop runs the step again. Its
    forward's first block ends the failed step (its tries counted afresh), re-plans, and the numbers are an
    undisturbed run's."""
    ref_losses, ref_params, _ = _reference(2, budget_blocks=8)
    rt, model, compiled, optimizer, x = _offloaded(budget_blocks=8)  # room for four smaller plans
    for call in range(1, 5):  # the first try and its three recoveries, all in step 0
        _fail_once(rt, block=3, kind="forward", at_call=call)
    optimizer.zero_grad(set_to_none=True)
    with pytest.warns(OutOfMemoryWarning, match="ran it again"), pytest.raises(torch.OutOfMemoryError):
        compiled(x)
    step = rt.phases.step
    with pytest.warns(OutOfMemoryWarning, match="the last forward .* must be run again"):
        losses = _train(compiled, optimizer, x, 2)
    assert losses == ref_losses
    _same(_params(model), ref_params)
    actions = [r["action"] for r in rt.stats()["oom_recoveries"]]
    assert actions[:4] == ["ran it again"] * 3 + ["raised"] and "must be run again" in actions[4]
    assert rt.phases.step == step + 3  # the failed step ended when the rerun's forward began
