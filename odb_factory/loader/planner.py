"""The planner thread: fills the window, groups, aligns, and queues planned steps.

It runs off the training thread and owns the Gloo side channel while an epoch runs (the
channel is never used from two threads at once). Stopping early (the trainer broke out
of the loop) is safe: a planner only gives up while blocked on a full queue, and every
rank's queue fills at the same step, so no rank is left alone inside a collective.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..cost import SampleCost
from ..planning.grouping import PlannedSample
from ..planning.rounds import RankPlanner, Slot
from .balancer import StepBalancer
from .collate import END_OF_EPOCH, PlannerFailure, StepPlan
from .sync import SyncChannel


class _Stopped(Exception):
    pass


class PlannerThread(threading.Thread):
    def __init__(self, planner: RankPlanner, samples: Iterator[Tuple[int, Any, SampleCost]],
                 sync: SyncChannel, epoch: int, accumulation: int,
                 out: "queue.Queue", stop: threading.Event,
                 filler: Callable[[], Any], step_offset: int = 0, pad_to_window: bool = False,
                 balancer: Optional[StepBalancer] = None):
        super().__init__(name=f"odb-planner-rank{sync.rank}-epoch{epoch}", daemon=True)
        self.planner = planner
        self.samples = samples
        self.sync = sync
        self.epoch = epoch
        self.accumulation = accumulation
        self.out = out
        self.stop = stop
        self.fetch_filler = filler
        self.step = step_offset
        self.pad_to_window = pad_to_window
        self.balancer = balancer
        self.payloads: Dict[int, Any] = {}
        self.filler: Optional[Any] = None
        self.planner.stream = self._stream()

    def _stream(self) -> Iterator[PlannedSample]:
        for uid, (index, sample, cost) in enumerate(self.samples):
            self.payloads[uid] = sample
            yield PlannedSample(uid, index, cost)

    def run(self) -> None:
        try:
            self._plan_epoch()
            self._put(END_OF_EPOCH)
        except _Stopped:
            pass
        except BaseException as exc:  # surfaced in the training thread by PlanSampler
            try:
                self._put(PlannerFailure(exc))
            except _Stopped:
                pass

    def _put(self, item: Any) -> None:
        while True:
            try:
                self.out.put(item, timeout=0.2)
                return
            except queue.Full:
                if self.stop.is_set():
                    raise _Stopped()

    def _plan_epoch(self) -> None:
        planner, sync = self.planner, self.sync
        window: List[Slot] = []
        while not planner.finished:
            status = planner.begin_round()
            statuses = sync.all_gather(status, "status", self.epoch, planner.round)
            costs = planner.plan_round(statuses)
            if planner.finished:
                break
            stats = planner.last_round_stats
            every = sync.all_gather(costs, "costs", self.epoch, planner.round)
            slots = planner.close_round(every)
            round_stats = {"groups_per_round": float(stats.target), "splits": float(stats.splits),
                           "overflow_groups": float(stats.overflow_groups),
                           "over_budget": float(stats.over_budget)}
            if self.balancer is not None and slots:
                slots, balance_stats = self.balancer.rebalance(slots, planner.last_round_costs,
                                                               self.payloads, self.epoch)
                round_stats.update(balance_stats)
            for slot in slots:
                window.append((slot, round_stats))
                round_stats = {}  # count round-level figures once, on the round's first step
                if len(window) == self.accumulation:
                    self._emit(window)
                    window = []
        if window and self.pad_to_window:
            # IDLE steps complete the last accumulation window, so the trainer's
            # every-N-micro-steps optimizer step also covers the epoch's last samples.
            while len(window) < self.accumulation:
                window.append((Slot((), planner.round, len(window), 0, 0, 0), {}))
        if window:
            self._emit(window)
        self.payloads.clear()

    def _emit(self, window: List[Tuple[Slot, Dict[str, float]]]) -> None:
        window_tokens = sum(slot.global_label_tokens for slot, _ in window)
        for slot, round_stats in window:
            if slot.is_idle:
                samples = [self._filler()]
            else:
                samples = [self.payloads.pop(s.uid) for s in slot.samples]
                shortest = min(range(len(samples)), key=lambda i: slot.samples[i].cost.tokens)
                self.filler = samples[shortest]
            self._put(StepPlan(
                epoch=self.epoch, step=self.step, round=slot.round, samples=samples,
                indices=[s.index for s in slot.samples], is_idle=slot.is_idle,
                num_tokens=slot.label_tokens, num_input_tokens=slot.tokens,
                padded_tokens=slot.padded_tokens,
                vision_patches=sum(s.cost.vision_patches for s in slot.samples),
                global_num_tokens=window_tokens,
                global_num_samples=slot.global_samples, round_stats=round_stats))
            self.step += 1

    def _filler(self) -> Any:
        if self.filler is None:
            self.filler = self.fetch_filler()
        return self.filler
