"""Out of device memory in the middle of a step: re-plan under what is free now, and run the unit again.

A compiled unit that fails to allocate raises before it returns anything, so its boundary is a safe place to start
again: the units call `recover` (compiler/units.py, compiler/recompute.py), which releases the unit's slots, hands
the cache back and plans for the room (free plus reserved, within the memory fraction) less a margin (a room that
did not shrink: the budget less SHRINK_FRACTION of the plan's weights); failing again, the next plan also leaves out
the cache's fragments. Each recovery warns and is kept in `stats()["oom_recoveries"]`; `regrow` raises the budget
again (every `oom_regrow_every` steps) up to the user's, unless the user re-planned meanwhile. Not retried, and said
so: a backward not recomputed (the next forward releases the held slots and re-plans), a recomputed backward whose
streamed weights train (its gradients would go home twice), `MAX_TRIES` failures of a unit in a step, no plan that
fits. A step whose backward raised is never half-applied: the optimizer refuses it (`BackwardIncompleteError`)
and the next forward drops its gradients.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch

from torch_stagehand.environment import tunable
from torch_stagehand.runtime.device.allocator import allocator_ooms, device_room, fragmented_bytes
from torch_stagehand.runtime.conductor.costs import Budget, BudgetError, human
from torch_stagehand.runtime.conductor.phases import Phase
from torch_stagehand.runtime.conductor.driver import SHRINK_FRACTION

log = logging.getLogger(__name__)

MAX_TRIES = 3  # recoveries of one unit in one step before the error is let through
# The budget after a recovery leaves this much of the room free: the allocator rounds and fragments,
# and whatever took the memory may take a little more.
MARGIN_FRACTION, MIN_MARGIN = 0.05, 16 * 2**20
FRAGMENTED_NOTE = 0.25  # of the room: above it, a refusal says how to stop the fragmentation
# While a recovery keeps the budget below the user's, the room is read every `oom_regrow_every` steps (a driver call,
# no synchronisation), and the plan is re-made when it grew by more than REGROW_STEP of the budget in force.
REGROW_STEP = 0.10


class BackwardIncompleteError(RuntimeError):
    """The optimizer was asked to step on the gradients of a backward that raised."""


class OutOfMemoryWarning(UserWarning):
    """The runtime ran out of device memory in a step and re-planned (or could not, and says why)."""


class OomRecovery:
    """Out of device memory at a unit's boundary: re-plan through the driver for the room left, and say so.
    `attached`: the optimizers whose gradients a refused step must not leave behind."""

    def __init__(self, device: torch.device, blocks: list[str], phases, driver, abort_held_blocks: Callable[[], None],
                 attached: list, allocator: str = ""):
        self.device, self.blocks, self.phases, self.driver = device, blocks, phases, driver
        self.abort_held_blocks, self.attached = abort_held_blocks, attached
        self.allocator = allocator  # what offload did to the caching allocator (device/allocator.py's note)
        self.records: list[dict[str, Any]] = []  # one per recovery (and per refusal): stats()["oom_recoveries"]
        self._tries: dict[str, int] = {}  # unit -> recoveries in this step
        # The allocator's count of refused allocations when every refusal so far was accounted for (at a
        # forward's start, after a recovery, after a plan application: the driver shrinks or raises itself).
        self._ooms_seen = allocator_ooms(self.device)
        self._first_block: int | None = None  # the block the current forward waited for first
        self._first_step, self._other_block_seen = -1, False  # its step; another block waited for since
        self._backward_entered = False  # this step reached a block's backward op
        self._forward_raised = False  # a unit of this step's forward raised out of memory (not run again)
        self._backward_done: bool | None = None  # the last backward reached its end (None: not watched)
        self._ended_from: Phase | None = None  # the phase the last step ended from
        self._refused = False  # the optimizer was refused after the last backward (it did not finish)
        self._failed_in_a_row = 0  # steps in a row that raised (a step run again that failed again)
        self._user_budget: tuple[Budget, bool] | None = None  # (budget, planning) before the first recovery
        self._ours: Budget | None = None  # the budget the last recovery or regrow set (a user's replan replaces it)
        self.phases.listeners.append(self.on_phase)
        # Before every other listener: a refused optimizer phase must not start anything (the host lanes).
        self.phases.listeners.insert(0, self._before_optimizer)
        self.phases.new_forward_checks.append(self._new_forward)
        self.driver.on_refusals.append(self._handled_by_the_driver)
        self.driver.on_refused_prefetch.append(self.note_handled)

    def _handled_by_the_driver(self, refused: int) -> None:
        self._ooms_seen += refused  # refused while a plan was applied: the driver shrank its budget or raised

    def recover(self, where: str, error: BaseException, trainable_backward: bool = False) -> bool:
        """`where` (a unit) raised `error`, out of memory, at its boundary. Re-plan; True: run it again."""
        self.abort_held_blocks()  # the unit's evict never ran
        # This unit's refusal and any earlier one of this forward someone caught are accounted for.
        self._ooms_seen = max(self._ooms_seen, allocator_ooms(self.device))
        tries = self._tries[where] = self._tries.get(where, 0) + 1
        self._forward_raised = self.phases.phase is Phase.FORWARD  # until it runs again
        if trainable_backward:
            return self._refuse(where, error, "its backward sends the streamed weights' gradients home as it "
                                "runs; a second run would send them twice")
        if tries > MAX_TRIES:
            return self._refuse(where, error, f"it ran out of memory {MAX_TRIES} times in this step"
                                + self._fragmentation_note())
        try:  # failing again under a plan made for the room: its cached pieces are too small (fragments)
            before, after = self._replan(f"out of memory in {where}", without_fragments=tries > 1)
        except (BudgetError, torch.OutOfMemoryError) as e:
            return self._refuse(where, error, f"no plan fits the memory left ({e})")
        self._record(where, error, before, after, "ran it again")
        self._forward_raised = False
        return True

    def on_phase(self, old: Phase, new: Phase) -> None:
        """A backward is watched to its end (`_watch_backward`). A forward after a step that raised releases the
        slots it left held, drops partial gradients, and re-plans when a refusal went unhandled."""
        if new is Phase.BACKWARD:
            self._backward_entered = True
            self._watch_backward()
        if new is Phase.STEP_END:
            self._ended_from = old
            if self._user_budget is not None and (self.phases.step + 1) % tunable("oom_regrow_every") == 0:
                self.regrow()
        if new is not Phase.FORWARD or old is Phase.FORWARD or self.driver.pool is None:
            return
        self._tries.clear()  # a new forward: every unit may recover again
        held = self._held_blocks()
        ooms = allocator_ooms(self.device)
        # (a unit that gave up had its refusal accounted when it tried to recover: its flag says it raised)
        out_of_memory, self._ooms_seen = ooms > self._ooms_seen or self._forward_raised, ooms
        # A refusal no recovery handled in a step that ended before its optimizer: its forward raised, or its
        # backward raised before its first block (the loss's own backward), where no block's op watches it.
        early = out_of_memory and (self._ended_from is Phase.FORWARD
                                   or (self._ended_from is Phase.BACKWARD and self._backward_done is not True))
        failed = bool(held) or self._backward_done is False or early or self._refused
        # Gradients of a backward that ran in part; a forward that raised left the ones accumulated before it.
        partial = self._backward_entered or self._refused or (early and not self._forward_raised)
        self._backward_done, self._refused, self._backward_entered, self._forward_raised = None, False, False, False
        self._failed_in_a_row = self._failed_in_a_row + 1 if failed else 0
        if not failed:
            return
        self.abort_held_blocks()
        part = "backward" if partial else "forward"
        where = f"the {part} of block {held[0]} ({self.blocks[held[0]]})" if held else f"the last {part}"
        dropped = self._drop_partial_gradients() if partial else ""
        if not out_of_memory:  # it raised something else: nothing to re-plan for
            warnings.warn(f"stagehand: {where} did not finish (it raised); its slots are released{dropped}",
                          OutOfMemoryWarning, stacklevel=2)
            return
        try:  # the run again of a step failed too: the cache's fragments are not room either
            before, after = self._replan(f"out of memory in {where}", without_fragments=self._failed_in_a_row > 1)
        except (BudgetError, torch.OutOfMemoryError) as e:
            self._refuse(where, None, f"no plan fits the memory left ({e})")
            return
        self._record(where, None, before, after, "its step raised and must be run again (the optimizer did "
                     f"not step on it); this forward runs under the new plan{dropped}")

    def _new_forward(self, block: int) -> bool:
        """A forward op of `block` (PhaseTracker.new_forward_checks): True when it is the forward's first block again
        after an allocator refusal nothing handled (the step before raised). Two forwards of one step stay one."""
        phases = self.phases
        if phases.phase is not Phase.FORWARD or self._first_block is None or self._first_step != phases.step:
            # this op begins a forward (or the first block op of one an eager layer began); after a backward or
            # an optimizer the tracker ends that step first: this forward belongs to the next one
            ends_a_step = phases.phase in (Phase.BACKWARD, Phase.OPTIMIZER)
            self._first_block, self._first_step, self._other_block_seen = block, phases.step + ends_a_step, False
            return False
        if block != self._first_block:
            self._other_block_seen = True  # (a block split by a graph break waits twice in a row: not a new forward)
            return False
        if self._forward_raised:  # a unit of this forward gave up and raised: that forward is over
            return True
        return self._other_block_seen and allocator_ooms(self.device) > self._ooms_seen

    def _held_blocks(self) -> list[int]:
        """Blocks whose slots a reader still holds (between steps: a unit that raised before its evict)."""
        return [s.key[0] for s in self.driver.pool.all_slots() if s.holds]

    def note_handled(self) -> None:
        """An allocator refusal its caller handled (a prefetch left to the block's wait): it ended no step."""
        self._ooms_seen = max(self._ooms_seen, allocator_ooms(self.device))

    def _watch_backward(self) -> None:
        """Ask autograd's engine to say when this backward ends (its callbacks run only when no node raised)."""
        if torch._C._current_graph_task_id() == -1:
            self._backward_done = None
            return
        self._backward_done = False
        torch.autograd.Variable._execution_engine.queue_callback(lambda: setattr(self, "_backward_done", True))

    def _before_optimizer(self, old: Phase, new: Phase) -> None:
        """The optimizer is about to step: refuse, until the next forward, when the backward before it raised (its
        gradients are partial), or, straight from the forward, after an allocator refusal nothing handled."""
        if new is not Phase.OPTIMIZER or self.driver.pool is None:
            return
        held = self._held_blocks()
        early = old is Phase.FORWARD and allocator_ooms(self.device) > self._ooms_seen
        if self._refused or (old is Phase.BACKWARD and (held or self._backward_done is False)) or early:
            why = (f"block {held[0]} ({self.blocks[held[0]]}) is still held by it" if held
                   else "the allocator refused memory after the forward and no recovery handled it" if early
                   else "it raised")
            self._refused = True
            raise BackwardIncompleteError(
                f"stagehand: the optimizer must not step at step {self.phases.step}: the backward before it "
                f"did not finish ({why}), so its gradients are partial. Zero them (optimizer.zero_grad()) and "
                "run the step again: its next forward releases the held memory and re-plans")

    def _drop_partial_gradients(self) -> str:
        """Drop the gradients the failed backward left in the attached optimizers' parameters; the warning's words."""
        params = [p for opt in self.attached for g in opt.param_groups for p in g["params"] if p.grad is not None]
        for p in params:
            p.grad = None
        if not params:
            return ""
        return (f"; the partial gradients of {len(params)} parameters were dropped (an accumulation window that "
                "ran before it must run again)")

    def _replan(self, reason: str, without_fragments: bool = False) -> tuple[str, str]:
        """Make and apply the plan for the room left (`without_fragments`: less unusable cached bytes); the budgets."""
        driver = self.driver
        old_budget, old_planning, plan = driver.budget, driver.planning, driver.plan
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the cache back: the retry may find the memory in one piece
        room = device_room(self.device)
        if room is not None and without_fragments:
            room -= fragmented_bytes(self.device)
        limit = old_budget.limit
        ceiling = min(limit, plan.predicted_peak_bytes) if limit is not None else plan.predicted_peak_bytes
        new = None if room is None else int(room - max(MIN_MARGIN, MARGIN_FRACTION * room))
        if new is None or new >= ceiling:  # the room did not shrink below the plan: it predicted too little
            new = int(ceiling - SHRINK_FRACTION * plan.weight_bytes)
        if new <= 0:
            raise BudgetError(f"the room left on {self.device} ({human(room or 0)}) holds no plan")
        # Soft: the new limit; hard: the room itself (less the least margin), for when nothing fits the soft one.
        hard = new if room is None else max(new, int(room - MIN_MARGIN))
        driver.budget, driver.planning = Budget(new, hard), True
        try:
            driver.apply(reason)
        except (BudgetError, torch.OutOfMemoryError):
            driver.budget, driver.planning = old_budget, old_planning
            raise
        if self._user_budget is None:  # the budget the user gave (or none): regrow() returns to it
            self._user_budget = (old_budget, old_planning)
        self._ours = driver.budget
        return old_budget.describe(), driver.budget.describe() + ("" if room is None else f"; room {human(room)}")

    def regrow(self) -> None:
        """Between steps, while a recovery keeps the budget below the user's: when the room grew, plan for it, up to
        the user's budget (then regrowing stops). A plan that does not fit leaves the budget as it was."""
        driver, (user, user_planning) = self.driver, self._user_budget
        if driver.budget is not self._ours:  # the user re-planned since (rt.replan): theirs stands
            self._user_budget = None
            return
        room = device_room(self.device)
        if room is None:
            return
        cap = int(room - max(MIN_MARGIN, MARGIN_FRACTION * room))
        target = cap if user.limit is None else min(cap, user.limit)
        current = driver.budget.limit
        if current is not None and target <= current * (1 + REGROW_STEP):
            return  # not enough more room to pay for a re-plan
        before = driver.budget
        back = user.limit is not None and target >= user.limit
        driver.budget = user if back else Budget(target, target)
        try:
            driver.apply("the device has room again")
        except (BudgetError, torch.OutOfMemoryError):
            driver.budget = before
            return
        self._ours = driver.budget
        if back:
            driver.planning, self._user_budget = user_planning, None
        self.records.append({"step": self.phases.step, "where": "between steps", "budget_before": before.describe(),
                             "budget_after": f"{driver.budget.describe()}; room {human(room)}",
                             "plan": self.driver.plan.summary(),
                             "action": "the user's budget is back" if back else "budget raised with the room"})
        log.warning("stagehand: the device has room again (%s): budget %s -> %s", human(room), before.describe(),
                    driver.budget.describe())

    def _fragmentation_note(self) -> str:
        device = self.device
        room, scattered = device_room(device), fragmented_bytes(device)
        if room is None or scattered < FRAGMENTED_NOTE * room:
            return ""
        if "expandable_segments:True" in self.allocator:
            way_out = ("expandable segments are on: the gaps lie between tensors the step still holds; the step "
                       "run again plans without them, or give a smaller vram_budget")
        else:
            way_out = "start the run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        return (f"; {human(scattered)} of the {human(room)} this process may hold are reserved but in pieces too "
                f"small for the allocation (fragmentation): {way_out}")

    def _record(self, where: str, error: BaseException | None, before: str, after: str, action: str) -> None:
        record = {"step": self.phases.step, "where": where, "budget_before": before, "budget_after": after,
                  "plan": self.driver.plan.summary(), "action": action, "error": _first_line(error)}
        self.records.append(record)
        warnings.warn(f"stagehand: out of device memory in {where} at step {record['step']}; re-planned "
                      f"(budget {before} -> {after}: {record['plan']}) and {action}", OutOfMemoryWarning, stacklevel=3)

    def _refuse(self, where: str, error: BaseException | None, why: str) -> bool:
        self.records.append({"step": self.phases.step, "where": where, "action": "raised", "why": why,
                             "error": _first_line(error)})
        log.error("stagehand: out of device memory in %s; not run again: %s", where, why)
        return False


def _first_line(error: BaseException | None) -> str:
    return "" if error is None else (str(error).splitlines() or [type(error).__name__])[0][:300]
