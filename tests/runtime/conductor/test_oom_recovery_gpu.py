"""On a CUDA device: a real out-of-memory in the middle of a step (a per-process memory fraction lowered
below what the plan needs) is caught at the block, the runtime re-plans under the room left and the step
finishes with the numbers of an undisturbed step.

Run on the device machine with `pytest -m gpu tests/runtime/conductor/test_oom_recovery_gpu.py`; skipped without CUDA.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import torch_stagehand as stagehand
from torch_stagehand.runtime.conductor.oom_recovery import OutOfMemoryWarning, allocator_ooms, device_room

from _helpers import rel_err, square_loss_step, toy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, D = 8, 1024


_step = square_loss_step


def _step_as_a_loop_does(call, model, x, optimizer):
    """A step; a backward that ran out of memory (a non-recomputed block's backward cannot run again inside it,
    conductor/oom_recovery.py) raises before the optimizer stepped, and the loop runs the step again."""
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    failed = False
    try:
        result = _step(call, model, x)
    except torch.OutOfMemoryError:
        failed = True  # run again outside this clause: its traceback holds the failed step's activations
    if failed:
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters() if p.requires_grad)
        result = _step(call, model, x)  # the next forward releases the held slots and re-plans
    optimizer.step()
    return result


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_memory_fraction_lowered_mid_run_is_survived_with_the_same_numbers(inner):
    model, x = toy(d=D, n=N)
    for block in model.blocks:
        block.norm.requires_grad_(True)
    x = x.cuda().repeat(8, 64, 1)  # activations of ~50 MB a block: what the lowered cap cannot hold
    ref_model = copy.deepcopy(model).cuda()
    ref_out, ref_grads = _step(ref_model, ref_model, x)
    del ref_model
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    rt = stagehand.offload(model, device="cuda", vram_budget="40GiB")  # every block resident
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    rt.attach(optimizer)
    compiled = torch.compile(model, backend="stagehand", options={"inner": inner})
    for _ in range(3):  # calibration, then the planned plan
        _step(compiled, model, x)
        optimizer.step()
    assert rt.stats()["resident_blocks"] == N
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    cap = torch.cuda.memory_reserved() + 200 * 2**20  # the weights fit, the step's activations do not
    ooms = allocator_ooms(torch.device("cuda"))
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        assert device_room(torch.device("cuda")) <= cap
        with pytest.warns(OutOfMemoryWarning, match="re-planned"):
            out, grads = _step_as_a_loop_does(compiled, model, x, optimizer)
        torch.cuda.synchronize()
        assert allocator_ooms(torch.device("cuda")) > ooms  # the allocator really refused
        records = rt.stats()["oom_recoveries"]
        # Recovered inside the step, or (a late block of a forward whose earlier activations are already held,
        # three times) raised before the optimizer stepped and ran again under the new plan: both are the contract.
        assert records and records[-1]["action"] != "raised" or len(records) >= 2, records
        assert rt.stats()["resident_blocks"] < N
        assert rel_err(out, ref_out) < 1e-4 and max(rel_err(grads[k], ref_grads[k]) for k in grads) < 1e-4
        out, grads = _step(compiled, model, x)  # the next step runs under the new plan, no recovery
        optimizer.step()
        assert len(rt.stats()["oom_recoveries"]) == len(records)
        assert rel_err(out, ref_out) < 1e-4
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    rt.restore()


def test_allocated_bytes_reads_what_torch_memory_allocated_reads():
    """The schedule's admissions read the allocated bytes from the nested statistics (allocator.allocated_bytes):
    the same number torch.cuda.memory_allocated flattens every statistic to find."""
    from torch_stagehand.runtime.device.allocator import allocated_bytes

    device = torch.device("cuda")
    before = allocated_bytes(device)
    assert before == torch.cuda.memory_allocated(device)
    held = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    assert allocated_bytes(device) == torch.cuda.memory_allocated(device) >= before + held.numel()
    del held
    assert allocated_bytes(device) == torch.cuda.memory_allocated(device) == before
    assert allocated_bytes(torch.device("cpu")) == 0
