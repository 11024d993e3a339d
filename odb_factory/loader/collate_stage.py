"""Group stage: collate each planned group in parallel collation workers.

The collation pool is a second torch DataLoader whose sampler yields planned steps (with
their samples) straight from the planner's queue and whose "dataset" applies the user's
collate function: public DataLoader API only, ordered results, worker errors with their
original traceback, and `num_collate_workers` processes working on different groups.
With no collate workers the training thread runs CollateJob itself, without a DataLoader.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator, List, Optional, Tuple

from torch.utils.data import Dataset, Sampler, get_worker_info

from .payload import Compact, unpack
from .planner_thread import END_OF_EPOCH, PlannerFailure, StepPlan


class CollateJob(Dataset):
    """job[plan] -> (plan without its samples, collate_fn(samples)).

    The samples arrive packed (payload.py) and are unpacked here, once; in a collate worker
    the result goes back as one blob too."""

    def __init__(self, collate_fn: Callable[[List[Any]], Any]):
        self.collate_fn = collate_fn

    def __getitem__(self, plan: StepPlan) -> Tuple[StepPlan, Any]:
        if plan.replayed:
            return plan, None
        data = self.collate_fn([unpack(sample) for sample in plan.samples])
        plan.samples = []  # do not ship the samples back
        if get_worker_info() is not None:
            data = Compact(data)
        return plan, data


class PlanSampler(Sampler):
    """Yields the current epoch's StepPlans from the planner queue, in order."""

    source: Optional["queue.Queue"]
    planner: Optional[threading.Thread]

    def __init__(self) -> None:
        self.detach()

    def attach(self, source: "queue.Queue", planner: threading.Thread) -> None:
        self.source, self.planner = source, planner

    def detach(self) -> None:
        self.source, self.planner = None, None

    def __iter__(self) -> Iterator[StepPlan]:
        source, planner = self.source, self.planner
        if source is None:
            return
        while True:
            try:
                # the poll only bounds how soon a planner that stopped is noticed
                item = source.get(timeout=1.0)  # pragma: no mutate, see above
            except queue.Empty:
                if planner is not None and not planner.is_alive() and source.empty():
                    raise RuntimeError("the ODB planner thread stopped without a result")
                continue
            if item is END_OF_EPOCH:
                return
            if isinstance(item, PlannerFailure):
                raise item.exc
            yield item
