"""The epoch planner: fills the window, groups, aligns, and hands out planned steps.

With sample or collate workers it runs in a planner thread, off the training thread, and
queues its steps ahead (`PlannerThread`). With neither it runs inline, in the training
thread, one step when the trainer asks for it (`EpochPlanner.inline_plans`): like a torch
DataLoader with num_workers=0, nothing overlaps with the step, and nothing competes with
the training thread for the GIL either. Either way one thread at a time owns the Gloo side
channel while an epoch runs.

Leaving early is announced, never silent: when the trainer stops iterating (`leave()`)
or this rank's pipeline fails, the planner takes part in the peers' next exchange with a
`Departure` (unless the protocol is already over), so every peer learns within that
exchange which rank left, after which step, and why. A peer that keeps iterating past
that step gets an error naming the rank instead of a hang or a silent mismatch.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..comm.channel import Departure, PeerDeparted, SyncChannel
from ..comm.errors import ODBSyncError
from ..cost import SampleCost
from ..planning.grouping import Budget, PlannedSample
from ..planning.grouping import form_groups
from ..planning.optimizer_steps import StandardStep, align_step, sample_weights
from ..planning.rounds import RankPlanner, Slot
from .step_rebalancer import StepRebalancer


@dataclass
class StepPlan:
    """A planned step, as the planner thread hands it to the collation stage."""
    epoch: int
    step: int
    round: int
    samples: List[Any]            # processed samples (a filler sample when idle)
    indices: List[int]            # dataset indices trained ([] when idle)
    is_idle: bool
    label_tokens: int             # supervised tokens of this rank's group
    input_tokens: int             # LLM input tokens of this rank's group
    padded_tokens: int            # tokens the group occupies under the budget's cost
    vision_patches: int           # vision-encoder patches of this rank's group
    audio_frames: int             # valid audio mel frames of this rank's group
    global_label_tokens: int      # supervised tokens of the whole accumulation window
    global_num_samples: int       # samples of this step on all ranks
    round_stats: Dict[str, float] = field(default_factory=dict)
    sample_weights: List[float] = field(default_factory=list)  # samples mode: Standard's loss weights
    step_end: bool = False        # the last micro-step of an optimizer step
    replayed: bool = False        # trained before the resumed state was saved: planned again
                                  # (the same exchanges on every rank), neither collated nor yielded


class PlannerFailure:
    """Carries an exception from the planner thread to the training thread."""

    def __init__(self, exc: BaseException):
        self.exc = exc


END_OF_EPOCH = "end-of-epoch"


class SampleStore:
    """Numbers this rank's incoming samples (uids) and keeps their payloads until emitted.

    `stream()` is what the RankPlanner reads: PlannedSamples whose payloads stay here, so
    only costs travel through planning and alignment."""

    def __init__(self, samples: Iterator[Tuple[int, Any, SampleCost]]):
        self._samples = samples
        self.payloads: Dict[Any, Any] = {}

    def stream(self) -> Iterator[PlannedSample]:
        for uid, (index, sample, cost) in enumerate(self._samples):
            self.payloads[uid] = sample
            yield PlannedSample(uid, index, cost)


@dataclass
class OptimizerStepSpec:
    """Samples mode: the Standard steps to train (this rank's share) and how to pack them."""
    steps: List[StandardStep]
    budget: Budget
    over_budget: str
    normalization: str            # Standard's loss: "micro_mean" or "exact"
    first_step: int = 0           # index of steps[0] in the epoch (after a resume)


class _Stopped(Exception):
    pass


class EpochPlanner:
    """One epoch's planning on this rank: `plans()` yields its StepPlans in order."""

    def __init__(self, planner: Optional[RankPlanner], store: SampleStore, sync: SyncChannel, epoch: int,
                 accumulation: int, filler: Callable[[], Any], step_offset: int = 0,
                 pad_to_window: bool = False, rebalancer: Optional[StepRebalancer] = None,
                 optimizer_steps: Optional[OptimizerStepSpec] = None, replay: int = 0):
        self.planner = planner                  # groups mode (DGAP rounds)
        self.optimizer_steps = optimizer_steps  # samples mode
        self.store = store
        self.sync = sync
        self.epoch = epoch
        self.accumulation = accumulation
        self.stop = threading.Event()                    # set when the trainer leaves
        self.inline = False                              # run by inline_plans()
        self.fetch_filler = filler
        self.step = step_offset
        self.replay_until = step_offset + replay         # steps before it are replayed
        self.pad_to_window = pad_to_window
        self.rebalancer = rebalancer
        self.filler: Optional[Any] = None
        self._last_trained: Optional[Tuple[Slot, List[Any]]] = None  # the filler's source
        self.failure: Optional[BaseException] = None    # this rank's own pipeline failure
        self.peer_departure: Optional[PeerDeparted] = None
        self._last_step = -1                             # last step the trainer received
        self._trainer_failure: Optional[BaseException] = None
        self._protocol_over = False                      # no exchange left in this epoch

    # ------------------------------------------------------------ the training thread's side
    def leave(self, last_step: int, failure: Optional[BaseException] = None) -> None:
        """The trainer stops iterating after `last_step` (because of `failure`, if given)."""
        self._last_step = last_step
        if failure is not None and self._trainer_failure is None:
            self._trainer_failure = failure
        self.stop.set()
        if self.inline:  # nobody else will take part in the peers' next exchange
            self._announce_leaving()

    def error_before(self, step: int) -> Optional[BaseException]:
        """The error the trainer must raise instead of receiving `step`, if any."""
        if self.failure is not None:
            return self.failure
        departed = self.peer_departure
        if departed is None:
            return None
        if departed.failed:
            return departed
        if step > departed.last_step:
            return PeerDeparted(departed.departures, departed.what, departed.rank, asked_for=step)
        return None

    # ------------------------------------------------------------ planning
    def plans(self) -> Iterator[StepPlan]:
        if self.optimizer_steps is not None:
            yield from self._plan_optimizer_steps(self.optimizer_steps)
        else:
            yield from self._plan_rounds()
        self.store.payloads.clear()

    def inline_plans(self) -> Iterator[StepPlan]:
        """The plans, computed in the caller's thread as they are asked for. A failure is
        raised here, after the peers were told (leave() announces the trainer's own)."""
        self.inline = True
        try:
            yield from self.plans()
        except PeerDeparted as exc:
            self._protocol_over = True
            self.peer_departure = exc
            # every step before this exchange was handed out already
            raise exc if exc.failed else PeerDeparted(exc.departures, exc.what, exc.rank,
                                                      asked_for=self.step) from None
        except ODBSyncError:  # the peers saw the same broken exchange
            self._protocol_over = True
            raise

    def record_failure(self, exc: BaseException, announce: bool) -> None:
        """Planning failed with `exc`; `announce`: tell the peers (only this rank knows)."""
        if isinstance(exc, PeerDeparted):
            self.peer_departure = exc
        else:
            self.failure = exc
        was_over, self._protocol_over = self._protocol_over, True  # no exchange follows a failure
        if announce and not was_over:
            self.sync.announce_departure(self._departure("failed", exc), "failure notice")

    def _departure(self, reason: str, exc: Optional[BaseException] = None) -> Departure:
        message = f"{type(exc).__name__}: {exc}" if exc is not None else ""
        return Departure(self.sync.rank, self.epoch, reason, self._last_step, message)

    def _announce_leaving(self) -> None:
        """Tell the peers, in place of our next exchange, that the trainer stopped (and why)."""
        if not self._protocol_over:
            self._protocol_over = True
            failure = self._trainer_failure
            self.sync.announce_departure(
                self._departure("failed" if failure else "left", failure), "departure notice")

    def leave_protocol(self) -> None:
        """The trainer stopped: announce it in place of our next exchange, then stop."""
        self._announce_leaving()
        raise _Stopped()

    def _exchange(self, obj: Any, what: str, round: int) -> List[Any]:
        if self.stop.is_set():
            self.leave_protocol()
        try:
            return self.sync.all_gather(obj, what, self.epoch, round)
        except PeerDeparted:
            if self.stop.is_set():
                self._protocol_over = True  # we are leaving too
                raise _Stopped() from None
            raise

    def _plan_optimizer_steps(self, spec: OptimizerStepSpec) -> Iterator[StepPlan]:
        """Samples mode: one exchange per Standard step (micro-batch count, label tokens)."""
        stream = self.store.stream()
        for number, step in enumerate(spec.steps, start=spec.first_step):
            samples = [next(stream) for _ in step.indices]
            # this rank's share in as few budget-feasible micro-batches as grouping finds
            grouping = form_groups(samples, spec.budget, spec.over_budget)
            groups = grouping.groups
            label_tokens = [s.cost.label_tokens for s in samples]
            every = self._exchange((len(groups), sum(label_tokens), len(samples)), "optimizer step", number)
            global_tokens = sum(tokens for _, tokens, _ in every)
            global_samples = sum(count for _, _, count in every)
            weights = dict(zip((s.uid for s in samples), sample_weights(
                step, label_tokens, spec.normalization, self.sync.world_size, global_tokens)))
            slots = align_step(groups, [count for count, _, _ in every], spec.budget)
            # the step's global sample count rides on its first micro-step only
            window = [Slot(tuple(slot), number, position, global_tokens,
                           global_samples if position == 0 else 0, spec.budget.group_cost(slot))
                      for position, slot in enumerate(slots)]
            stats: Dict[str, float] = {}
            if self.rebalancer is not None:
                window, stats = self._rebalance_step(window, weights, number)
            if grouping.over_budget:
                stats = {**stats, "over_budget": float(len(grouping.over_budget))}
            if number == spec.first_step + len(spec.steps) - 1:
                self._protocol_over = True  # no exchange follows the last step
            yield from self._emit([(slot, stats if position == 0 else {})
                                   for position, slot in enumerate(window)], weights)
        self._protocol_over = True

    def _rebalance_step(self, window: List[Slot], weights: Dict[Any, float],
                        number: int) -> Tuple[List[Slot], Dict[str, float]]:
        """Samples mode with post-balancing: re-deal the step's micro-batches across ranks;
        each sample's loss weight travels with it (the gradient is unchanged)."""
        every = self._exchange([[s.cost for s in slot.samples] for slot in window], "step costs", number)
        payloads = self.store.payloads
        moved = self.rebalancer.rebalance(window, every, lambda uid: (payloads[uid], weights[uid]),
                                          self.epoch, step_totals=True)
        for uid in moved.sent_uids:
            del payloads[uid]
        for uid, (payload, weight) in moved.received.items():
            payloads[uid], weights[uid] = payload, weight
        return moved.slots, moved.metrics

    def _plan_rounds(self) -> Iterator[StepPlan]:
        """Groups mode: DGAP rounds over the window (docs/dgap.md)."""
        planner = self.planner
        window: List[Tuple[Slot, Dict[str, float]]] = []
        while not planner.finished:
            status = planner.begin_round()
            statuses = self._exchange(status, "status", planner.round)
            costs = planner.plan_round(statuses)
            if planner.finished:
                break
            every = self._exchange(costs, "costs", planner.round)
            result = planner.close_round(every)
            slots, stats = result.slots, result.stats
            round_stats = {"groups_per_round": float(stats.target), "splits": float(stats.splits),
                           "overflow_groups": float(stats.overflow_groups),
                           "over_budget": float(stats.over_budget)}
            if self.rebalancer is not None and slots:
                moved = self.rebalancer.rebalance(slots, result.costs, self.store.payloads.__getitem__,
                                                  self.epoch)
                for uid in moved.sent_uids:
                    del self.store.payloads[uid]
                self.store.payloads.update(moved.received)
                slots = moved.slots
                round_stats.update(moved.metrics)
            if planner.finished:
                self._protocol_over = True  # the rest is emitting; no exchange follows
            for slot in slots:
                window.append((slot, round_stats))
                round_stats = {}  # count round-level figures once, on the round's first step
                if len(window) == self.accumulation:
                    yield from self._emit(window)
                    window = []
        if window and self.pad_to_window:
            # IDLE steps complete the last accumulation window, so the trainer's
            # every-N-micro-steps optimizer step also covers the epoch's last samples.
            while len(window) < self.accumulation:
                window.append((Slot((), planner.round, len(window), 0, 0, 0), {}))
        self._protocol_over = True
        if window:
            yield from self._emit(window)

    def _emit(self, window: List[Tuple[Slot, Dict[str, float]]],
              weights: Optional[Dict[Any, float]] = None) -> Iterator[StepPlan]:
        """One optimizer step's micro-steps (groups mode: an accumulation window)."""
        if weights is None:
            window_tokens = sum(slot.global_label_tokens for slot, _ in window)
        else:  # samples mode: each slot carries the step's global label tokens
            window_tokens = window[0][0].global_label_tokens if window else 0
        for position, (slot, round_stats) in enumerate(window):
            if slot.is_idle:
                samples = [self._filler()]
            else:
                samples = [self.store.payloads.pop(s.uid) for s in slot.samples]
                self._last_trained = (slot, samples)
            plan = StepPlan(
                epoch=self.epoch, step=self.step, round=slot.round, samples=samples,
                indices=[s.index for s in slot.samples], is_idle=slot.is_idle,
                label_tokens=slot.label_tokens, input_tokens=slot.input_tokens,
                padded_tokens=slot.padded_tokens,
                vision_patches=sum(s.cost.vision_patches for s in slot.samples),
                audio_frames=sum(s.cost.audio_frames for s in slot.samples),
                global_label_tokens=window_tokens,
                global_num_samples=slot.global_samples,
                round_stats=round_stats,
                sample_weights=[weights[s.uid] for s in slot.samples] if weights is not None else [],
                step_end=position == len(window) - 1, replayed=self.step < self.replay_until)
            if plan.replayed:
                plan.samples = []
            self.step += 1
            yield plan

    def _filler(self) -> Any:
        """An IDLE step's sample: the shortest of the last trained step (picked only when
        an IDLE step needs it), else one fetched from the dataset."""
        if self._last_trained is not None:
            slot, samples = self._last_trained
            self._last_trained = None
            shortest = min(range(len(samples)), key=lambda i: slot.samples[i].cost.input_tokens)
            self.filler = samples[shortest]
        if self.filler is None:
            self.filler = self.fetch_filler()
        return self.filler


class PlannerThread(threading.Thread):
    """Runs an EpochPlanner off the training thread, queueing up to `out`'s size of steps."""

    def __init__(self, planner: EpochPlanner, out: "queue.Queue"):
        super().__init__(name=f"odb-planner-rank{planner.sync.rank}-epoch{planner.epoch}", daemon=True)
        self.planner = planner
        self.out = out

    def run(self) -> None:
        try:
            for plan in self.planner.plans():
                self._put(plan)
            self._put(END_OF_EPOCH)
        except _Stopped:
            pass
        except ODBSyncError as exc:  # the peers saw the same broken exchange
            self._fail(exc, announce=False)
        except BaseException as exc:
            self._fail(exc, announce=True)

    def _fail(self, exc: BaseException, announce: bool) -> None:
        """Surface `exc` in the training thread at once; tell the peers when only we know."""
        try:
            self.planner.record_failure(exc, announce)
            self._put(PlannerFailure(exc))
        except (_Stopped, ODBSyncError):
            pass

    def _put(self, item: Any) -> None:
        while True:
            try:
                self.out.put(item, timeout=0.2)
                return
            except queue.Full:
                if self.planner.stop.is_set():
                    self.planner.leave_protocol()
