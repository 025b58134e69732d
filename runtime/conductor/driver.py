"""The plan at run time: the planner's decisions applied to the slot pool and the prefetches.

Without a budget the plan is the fixed one (every block streamed through `Config.slot_count` slots, the model's
checkpointing decides recompute). With one, `PlanDriver` applies the planner's: resident blocks get their own copy
(`SlotPool.reconfigure`), `prefetch` fetches `lookahead` streamed blocks ahead. On CUDA (unless the cost model is
`frozen`) the smallest plan runs first and a step of it is measured (conductor/calibrate.py), then the plan is
re-made; the first `REFINE_STEPS` steps of every later plan measure each block again (`BlockClocks`) and the smaller
values stay. The measured model is kept on disk with the plan in force (conductor/cost_cache.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import torch

from torch_stagehand.runtime.conductor import cost_cache
from torch_stagehand.runtime.conductor.calibrate import FORWARD, BlockClocks, Calibration
from torch_stagehand.runtime.conductor.conductor import Conductor
from torch_stagehand.runtime.conductor.costs import Budget, BudgetError, CostModel, budget_from
from torch_stagehand.runtime.conductor.planner import Plan, build_plan, make_plan
from torch_stagehand.runtime.device.allocator import allocated_bytes, allocator_ooms, reserve
from torch_stagehand.runtime.device.slots import SlotPool
from torch_stagehand.runtime.device.spill import ActivationSpill
from torch_stagehand.runtime.host import budget as host_budget
from torch_stagehand.runtime.registry import NO_BLOCK

log = logging.getLogger(__name__)

# Steps run under the smallest plan before the measured one: the first compiles, so its times say nothing.
WARMUP_STEPS = 1
# A calibration step in which units compiled, loaded or first ran is measured again on the next, up to this often.
REMEASURE_TRIES = 2
REFINE_STEPS = 2  # steps of a new plan whose host and GPU times per block refine the cost model (the first compiles)
# A plan that does not fit when applied is re-made with this fraction of its weights fewer, up to SHRINK_TRIES times.
SHRINK_FRACTION, SHRINK_TRIES = 0.25, 10
# The first plan made from a calibration is planned this fraction of the budget under it (`on_step_end`).
FIRST_PLAN_MARGIN = 0.01


class PlanDriver:
    """The plan at run time, and the one owner of the budget and the slot pool it sizes. `precision`, `step` and
    `compiled_units` read the runtime's state; `kept` is the job's cost model on disk (`KeptCostModel`)."""

    def __init__(self, device: torch.device, n_blocks: int, config, store, grads, fetch_order,
                 precision: Callable[[], dict[int, str]], step: Callable[[], int | None],
                 compiled_units: Callable[[], int], kept, budget: Budget, cost_model: CostModel | None = None):
        self.device, self.n_blocks, self.config, self.store = device, n_blocks, config, store
        self.grads, self.fetch_order = grads, fetch_order
        self.precision, self.step, self.compiled_units = precision, step, compiled_units
        self.pool: SlotPool | None = None  # made by make_pool, for the first plan
        self.budget = budget
        # Told when a prefetch the driver issued was refused by the allocator (the conductor counted it).
        self.on_refused_prefetch: list[Callable[[], None]] = []
        # Told, after each plan application, how many allocations the device refused during it (the driver
        # handled those itself: it shrank the budget or raised); OOM recovery counts them as accounted for.
        self.on_refusals: list[Callable[[int], None]] = []
        self.planning = budget.limit is not None
        if cost_model is None:
            cost_model = CostModel()  # H2D bandwidth measured when a plan is first made for a budget
            if device.type == "cuda":  # what stays on the device besides the blocks, until a step is measured
                cost_model.base_bytes = allocated_bytes(device)
        self.cost_model = cost_model
        self.calibrated = cost_model.frozen or device.type != "cuda"
        self.conductor = Conductor(config.conductor, budget.soft, budget.hard, pressure=self._pressure,
                                   external=self._external)
        self._admit = self.conductor.enabled  # one attribute read on the hot path when disabled
        self.calibration: Calibration | None = None
        self._calibrate_at: int | None = None  # the step measured for calibration
        self.remeasured: list[int] = []  # calibration steps not used: one-time unit work in them
        self.plan: Plan | None = None
        self.spill: ActivationSpill | None = None  # made when a plan first spills
        self.shrinks: list[str] = []  # budgets shrunk because a plan did not fit when applied
        self._peak_check: str | None = None  # "pending" -> "measuring" over the first step of a new plan
        self.peak_corrections: list[str] = []  # what the measured peaks taught the cost model
        self.reservations: list[dict] = []  # memory held ahead for made plans' peaks (`reserve_for_plan`)
        self.peak_margin = 0  # planned this far under the budget: a peak's largest miss, or FIRST_PLAN_MARGIN's
        self.refining: BlockClocks | None = None  # over the first REFINE_STEPS steps of a planned plan
        self._refine_steps, self._unread = 0, []  # _unread: measured steps' GPU clocks not yet reached
        self.host_refinements = 0  # host issue times the later plans' steps lowered
        self.compute_refinements = 0  # GPU times per block the later plans' steps lowered
        self.kept = kept  # the measured model on disk, for the next run of this job

    def make(self) -> Plan:
        """The plan for the current precision map and cost model (not applied)."""
        model = self.cost_model
        costs, precision, _ = self._costs()
        if not self.planning:
            plan = build_plan(costs, precision, set(), None, self.config.slot_count, model, kind="fixed")
            plan.slot_bytes = self.store.max_block_bytes()  # any precision a block may switch to fits
            return plan
        if "h2d" not in model.measured and not model.frozen:
            model.learn_link(self.device, self.store.pin, self.store.node)
        if not self.calibrated:  # the smallest plan, measured before planning for real
            plan = build_plan(costs, precision, set(), set(range(len(costs))), 2, model, kind="calibrating",
                              budget=self.budget)
            plan.notes.append(f"runs {WARMUP_STEPS + 1} steps, the last one measured, then re-planned")
            return plan
        if not model.frozen:
            model.spill_room_bytes = self._spill_room()
        # Planned `peak_margin` under the budget once a measured peak missed its prediction, or a calibration set
        # one; under the budget itself when nothing fits with the margin.
        margin, budget = self.peak_margin, self.budget
        if margin:
            shrink = lambda v: None if v is None else max(1, v - margin)  # noqa: E731
            with contextlib.suppress(BudgetError):
                plan = make_plan(costs, precision, Budget(shrink(budget.soft), shrink(budget.hard)), model)
                plan.budget = budget
                plan.notes.append(f"planned {margin / 2**20:.0f} MiB under the budget: the largest peak a "
                                  f"prediction missed in this run, or the first calibrated plan's margin")
                return plan
        return make_plan(costs, precision, budget, model)

    def _spill_room(self) -> int:
        """Host memory the plan's spilled activations may take: a quarter of what a new allocation can take now
        stays for the rest of the process (the spill's own pooled buffers count as room: they are reused); under a
        pinned cap (Windows, WSL2), no more than the store's locked ranges leave of it (the pooled buffers are
        pinned by torch, outside those ranges: already in what is left)."""
        machine = host_budget.probe_machine()
        pooled = 0 if self.spill is None else self.spill.host_bytes
        room = machine.usable_bytes * 3 // 4 + pooled
        if self.store.pin and machine.pinned_cap_bytes is not None:
            locked = sum(arena.locked_bytes for arena in self.store.arenas)
            room = min(room, machine.pinned_cap_bytes - locked)
        return max(0, room)

    def _costs(self):
        """(the blocks' costs, the precision map, the cost model) a plan is made or predicted from."""
        model = self.cost_model
        self._training_costs(model)
        current = self.precision()
        precision = [current[b] for b in range(self.n_blocks)]
        return model.block_costs([self.store.nbytes(b, p) for b, p in enumerate(precision)]), precision, model

    def _training_costs(self, model: CostModel) -> None:
        """Full fine-tuning's costs: gradient bytes, the host optimizer's measured steps, device updates' states."""
        grads = self.grads
        grad_bytes = grads.grad_bytes()
        model.grad_bytes = grad_bytes if any(grad_bytes) else None
        if grads.optimizer_seconds and not model.frozen:
            known = grads.optimizer_seconds
            mean = sum(known.values()) / len(known)
            model.optimizer_s = [known.get(b, mean) if n else 0.0 for b, n in enumerate(grad_bytes)]
        model.count_device_updates(grads.device_updates)

    def apply(self, reason: str, plan: Plan | None = None, resumed: bool = False, reserve_peak: bool = True) -> Plan:
        """Apply `plan` (made by hand with `planner.build_plan`, which raises if it does not fit), else `make()`'s,
        re-made under a smaller budget while it does not fit on the device (another process, a memory fraction).
        `resumed`: `plan` is the one an earlier run ended on (`cost_cache.resumed_plan`), treated as made.
        `reserve_peak`: the allocator holds the predicted peak now. Refused allocations go to `on_refusals`."""
        before = allocator_ooms(self.device)
        try:
            return self._apply(reason, plan, resumed, reserve_peak)
        finally:
            refused = allocator_ooms(self.device) - before
            for listener in self.on_refusals:
                listener(refused)

    def _apply(self, reason: str, plan: Plan | None, resumed: bool, reserve_peak: bool) -> Plan:
        given = plan is not None and not resumed
        plan = plan or self.make()
        if self.pool is None or (plan.kind == "fixed" and self.plan is not None):
            self.plan = plan  # the fixed plan's pool never changes (its slots fit every precision)
            return plan
        for attempt in range(SHRINK_TRIES + 1):
            try:
                self.pool.reconfigure(plan.slots, plan.slot_bytes,
                                         {p.block: p.precision for p in plan.blocks if p.resident})
                break
            except torch.OutOfMemoryError as e:
                if given or not self.planning or attempt == SHRINK_TRIES:
                    raise torch.OutOfMemoryError(f"stagehand: the plan ({plan.summary()}) did not fit on "
                                                 f"{self.device} when applied ({reason}): {e}") from e
                self.pool.reconfigure(0, 0, {})  # free what the attempt placed
                limit = int(min(self.budget.limit, plan.predicted_peak_bytes) - SHRINK_FRACTION * plan.weight_bytes)
                self.budget = Budget(limit, min(self.budget.hard or limit, limit))
                note = f"the plan did not fit on the device ({reason}); budget shrunk to {self.budget.describe()}"
                self.shrinks.append(note)
                log.warning("stagehand: %s", note)
                try:
                    plan = self.make()
                except BudgetError as small:
                    raise torch.OutOfMemoryError(f"stagehand: no plan fits in what {self.device} has left "
                                                 f"({reason}; {small})") from e
        if not self.calibrated and plan.kind == "calibrating" and self._calibrate_at is None:
            self._calibrate_at = WARMUP_STEPS if self.step() is None else self.step() + WARMUP_STEPS
        self.plan = plan
        # The first step under a made plan measures its peak (`_check_peak`); a hand-made one is the user's.
        self._peak_check = "pending" if plan.kind == "planned" and not given and self.device.type == "cuda" else None
        self._refine_steps = REFINE_STEPS if plan.kind == "planned" else 0
        if self._admit:
            self.conductor.reserve_plan([p.bytes for p in plan.blocks if p.resident], plan.slot_bytes, plan.slots,
                                        plan.lookahead)
        log.info("stagehand: %s (%s)", plan.summary(), reason)
        if reserve_peak:
            self.reserve_for_plan()
        return plan

    def reserve_for_plan(self) -> None:
        """Have the allocator hold a made plan's predicted peak now, so its first step runs as the later ones do."""
        plan = self.plan
        if plan is None or plan.kind != "planned" or self.device.type != "cuda":
            return
        added, seconds = reserve(self.device, plan.predicted_peak_bytes)
        if added:
            self.reservations.append({"step": self.step(), "gib": round(added / 2**30, 2), "s": round(seconds, 3)})
            log.info("stagehand: the allocator holds %.2f GiB more for the plan's peak (%.0f ms)", added / 2**30,
                     seconds * 1e3)

    def make_pool(self) -> SlotPool:
        """The runtime's slot pool, allocated for the first plan (slots, then the resident blocks)."""
        plan = self.make()
        try:
            self.pool = SlotPool(self.device, plan.slots, plan.slot_bytes, self.store)
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(f"offload: no room on {self.device} for {plan.slots} slots of "
                                         f"{plan.slot_bytes / 2**20:.1f} MiB (the largest block): {e}") from e
        self.apply("offload")
        return self.pool

    def replan(self, cost_model: CostModel | None = None, vram_budget=None) -> Plan:
        """All or nothing: a budget no plan fits raises and leaves the plan, budget and cost model in force."""
        before = (self.cost_model, self.calibrated, self.budget, self.planning)
        if cost_model is not None:
            self.cost_model, self.calibrated = cost_model, True
        if vram_budget is not None:
            self.budget = budget_from(self.config, vram_budget)
            self.planning = True
        hand_back = self.device.type == "cuda" and vram_budget is not None
        try:
            plan = self.apply("replan()", reserve_peak=not hand_back)
        except (BudgetError, torch.OutOfMemoryError):
            self.cost_model, self.calibrated, self.budget, self.planning = before
            raise
        if hand_back:
            torch.cuda.empty_cache()  # a lower budget hands back what the allocator cached above it
            self.reserve_for_plan()
        return plan

    def on_graph(self, input_shapes: list[str]) -> None:
        """The first compiled graph, before it runs: a run not calibrated yet starts from the model an earlier run of
        the job kept, if any, and resumes the plan that run ended on (else the plan made from the model)."""
        model = self.kept.on_graph(input_shapes, load=not self.calibrated) if self.planning else None
        if model is not None:
            self.cost_model, self.calibrated, self._calibrate_at = model, True, None
            if not model.frozen:
                model.spill_room_bytes = self._spill_room()
            resumed = cost_cache.resumed_plan(self.kept.plan, *self._costs(), self.budget)
            self.apply("the calibrated cost model of an earlier run" + (", and the plan it ended on" if resumed else ""),
                       resumed, resumed=resumed is not None)

    def _decisions(self) -> dict | None:
        """The plan in force, as kept beside the cost model (a planned plan's only)."""
        return None if self.plan is None or self.plan.kind != "planned" else cost_cache.plan_decisions(
            self.plan, self.budget)

    def recompute_of(self, block: int) -> bool | None:
        return None if self.plan is None else self.plan.recompute_of(block)

    def spill_hooks(self, block: int):
        """The saved-tensor hooks that spill the block's activations to host, if the plan says so; else None."""
        if self.plan is None or block not in self.plan.spilled:
            return None
        if self.spill is None:
            self.spill = ActivationSpill(self.device, self.store.pin)
        return self.spill.hooks(block)

    def prefetch(self, block: int) -> None:
        """Fetch `block` (the one the schedule names next) and, per the plan, the streamed blocks after it."""
        pool, plan, precision_of = self.pool, self.plan, self.precision()
        if block == NO_BLOCK:
            return
        if plan is None or plan.kind == "fixed":
            pool.prefetch(block, precision_of[block])
            return
        backward = torch._C._current_graph_task_id() != -1
        if backward and self.spill is not None and block in plan.restored_ahead:
            # The activations the next backward reads outrank the weight copies issued after them (those of
            # blocks further on are speculative); one block ahead, as the plan's peak counts them.
            try:
                self.spill.restore(block, pool.copy_stream)
            except torch.OutOfMemoryError as e:  # an optimisation only: they come back when the backward reads them
                log.info("stagehand: block %d's activations not restored ahead: %s", block, e)
        resident = pool.resident_slots
        wanted, b, steps = [], block, 0
        while b != NO_BLOCK and len(wanted) < plan.lookahead and steps < self.n_blocks:
            if b not in resident:
                wanted.append(b)
            b = self.fetch_order.eager_next(b, backward)
            steps += 1
        for depth, b in enumerate(wanted):
            precision = precision_of[b]
            if not self._admit or pool.cached(b, precision):
                pool.prefetch(b, precision)  # a hit moves nothing: no token needed
                continue
            if self.conductor.admit_prefetch(b, depth) is not None:
                continue  # denied (counted with its reason): the block's wait fetches it later
            try:
                issued = pool.prefetch(b, precision)
            except torch.OutOfMemoryError as e:  # e.g. re-quantizing a stale INT8 copy on the device
                self.conductor.allocation_failed(b, e)
                for listener in self.on_refused_prefetch:
                    listener()
                return
            if not issued:
                self.conductor.copy_consumed(b)

    def on_wait(self, block: int, kind: str) -> None:
        if self._admit:
            self.conductor.copy_consumed(block)
        if kind == FORWARD and self.plan is not None and self.plan.kind != "fixed":
            learned = self.fetch_order.learned_order()
            if not learned or learned[-1] != block:  # a block split by a graph break is one entry
                self.fetch_order.record_forward(block)
        for clocks in (self.calibration, self.refining):
            if clocks is not None:
                clocks.on_wait(block, kind)

    def on_release(self, block: int) -> None:
        for clocks in (self.calibration, self.refining):
            if clocks is not None:
                clocks.on_release(block)

    def schedule_op_took(self, t0: float) -> None:
        """A schedule op (wait / prefetch / evict) started at host clock `t0` and ends now."""
        if self.calibration is not None:
            self.calibration.on_schedule_op(time.perf_counter() - t0)

    def on_phase(self, phase, step: int) -> None:
        if self._admit:
            self.conductor.on_phase(phase.value)
        if phase.value == "step_begin":
            self.on_step_begin(step)

    def _pressure(self) -> float:
        """Device memory in use over the hard cap (the device's size without one); a host read, no sync."""
        cap = self.budget.hard
        if self.device.type == "cuda":
            if cap is None:
                cap = self._device_total = getattr(self, "_device_total", None) or \
                    torch.cuda.get_device_properties(self.device).total_memory
            return allocated_bytes(self.device) / cap
        return self.pool.device_bytes() / cap if cap and self.pool is not None else 0.0

    def _external(self) -> int:
        """Device bytes the conductor does not reserve (everything but the streamed weights)."""
        if self.device.type != "cuda" or self.pool is None:
            return 0
        return max(0, allocated_bytes(self.device) - self.pool.device_bytes())

    def on_step_begin(self, step: int) -> None:
        if not self.calibrated and step == self._calibrate_at and self.calibration is None:
            # units compiled, loaded or first run in the measured step: one-time seconds in it
            self.calibration = Calibration(self.n_blocks, self.device, self.compiled_units)
        if self._peak_check == "pending" and self.calibration is None:
            torch.cuda.reset_peak_memory_stats(self.device)  # host-side counters: no synchronisation
            self._peak_check = "measuring"
        if self._refine_steps and self.calibration is None and self.cost_model.host_s is not None:
            self.refining = BlockClocks(self.n_blocks, self.device)

    def _check_peak(self, step: int, peak: int) -> None:
        """The first step of a new plan, measured: the excess of its peak over the prediction (the allocator's
        rounding, buffers only other plans have) joins `base_bytes`, and a peak over the soft cap re-plans at once."""
        self._peak_check = None
        plan = self.plan
        plan.measured_peak_bytes = peak
        excess = peak - plan.predicted_peak_bytes
        if excess <= 0:
            return
        self.cost_model.base_bytes += excess
        self.peak_margin = max(self.peak_margin, excess)
        note = (f"step {step}: measured peak {peak / 2**30:.2f} GiB, {excess / 2**20:.0f} MiB over the plan's "
                f"prediction; base bytes corrected")
        over = self.budget.soft is not None and peak > self.budget.soft
        if over:
            note += f" and re-planned (over the soft cap {self.budget.soft / 2**30:.2f} GiB)"
        self.peak_corrections.append(note)
        log.log(logging.WARNING if over else logging.INFO, "stagehand: %s", note)
        if over:
            self.apply(f"measured peak over the budget at step {step}")

    def on_step_end(self, step: int) -> None:
        learned = self.host_refinements + self.compute_refinements + len(self.peak_corrections)
        if self.refining is not None:  # before the peak check, which may re-plan
            clocks, self.refining = self.refining, None
            self._refine_steps -= 1
            self.host_refinements += self.cost_model.refine_host(clocks.host.seconds(), self.plan.resident)
            self._unread.append(clocks.gpu)
        # GPU times are read once their events are reached (this step's end or a later one's), never waited for;
        reached = [(t, t.done()) for t in self._unread]  # each asked once: an event may be reached meanwhile.
        self._unread = [t for t, done in reached if not done]
        self.compute_refinements += sum(self.cost_model.refine_compute(t.seconds()) for t, done in reached if done)
        if self._peak_check == "measuring":
            self._check_peak(step, torch.cuda.max_memory_allocated(self.device))
        if self.calibration is None:
            if learned != self.host_refinements + self.compute_refinements + len(self.peak_corrections):
                self.kept.keep(self.cost_model, self._decisions())  # refined or corrected: the next run starts here
            return
        calibration, self.calibration = self.calibration, None
        if calibration.one_time_work_in_step() and len(self.remeasured) < REMEASURE_TRIES:
            self.remeasured.append(step)  # one-time seconds are no plan's: the smallest plan measures the next step
            self._calibrate_at = step + 1
            log.info("stagehand: step %d compiled, loaded or first ran units: calibrating on the next step", step)
            return
        plan = self.plan
        self._training_costs(self.cost_model)  # the step's optimizer lane is predicted, not left in its residual

        def predict(model: CostModel) -> tuple[float, int]:
            precision = [p.precision for p in plan.blocks]
            costs = model.block_costs([p.bytes for p in plan.blocks])
            made = build_plan(costs, precision, set(), set(range(len(costs))), plan.slots, model, "calibrating")
            return made.predicted_step_s, made.predicted_peak_bytes

        self.cost_model = calibration.finish(self.cost_model, predict)
        self.calibrated = True
        # This plan's peak is predicted from a step of another plan and checked only after its first step, where a
        # miss over the cap would re-plan: a margin keeps such a miss inside.
        self.peak_margin = max(self.peak_margin, int(FIRST_PLAN_MARGIN * (self.budget.hard or self.budget.soft or 0)))
        self.apply(f"calibrated on step {step}", reserve_peak=False)
        if self.budget.limit is not None and torch.cuda.memory_reserved(self.device) > self.budget.limit:
            # The first steps' compile peaks left the allocator's cache above the budget: hand it back. Not
            # otherwise: the next step would ask the driver again for every block the cache held.
            torch.cuda.empty_cache()
        self.reserve_for_plan()
        self.kept.keep(self.cost_model, self._decisions())
