"""One rank's side of the alignment protocol, as a pure state machine.

A round has two exchanges; the driver performs them (a real all-gather in
`odb_factory.loader.planner`, a list in `odb_factory.planning.simulated_world`):

    status  = planner.begin_round()                  # fill the buffer, group it
    statuses = all_gather(status)
    costs   = planner.plan_round(statuses)           # T, split/overflow -> local per-slot costs
    every   = all_gather(costs)
    result  = planner.close_round(every)             # RoundResult: slots, kept costs, stats

Because both drivers run this same code, the property tests of the simulation test the
mechanism's decisions too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

from ..cost import SampleCost
from .alignment import RankStatus, fit_to_target, target_groups, trim_to_quota
from .grouping import Budget, PlannedSample, form_groups


@dataclass
class Slot:
    """One training step on one rank. No samples = an IDLE slot (trained with weight 0)."""
    samples: Tuple[PlannedSample, ...]
    round: int
    position: int                 # index within the round
    global_label_tokens: int      # supervised tokens of this step summed over all ranks
    global_samples: int           # samples of this step summed over all ranks
    padded_tokens: int            # tokens this rank's group occupies under the budget's cost

    @property
    def is_idle(self) -> bool:
        return not self.samples

    @property
    def label_tokens(self) -> int:
        return sum(s.cost.label_tokens for s in self.samples)

    @property
    def input_tokens(self) -> int:
        return sum(s.cost.input_tokens for s in self.samples)


@dataclass
class RoundStats:
    round: int
    target: int
    splits: int = 0
    overflow_groups: int = 0
    idle_slots: int = 0
    over_budget: int = 0


@dataclass
class RoundResult:
    """What a round hands on: this rank's slots, every rank's kept per-slot costs (what
    post-balancing plans over) and the round's figures."""
    slots: List[Slot]
    costs: List[List[List[SampleCost]]]   # costs[rank][slot]: the samples each rank trains
    stats: RoundStats


@dataclass
class RankPlanner:
    """Rank `rank`'s planner for one epoch.

    stream: this rank's samples in view order (finite in join mode, cycling in non-join).
    quota: non-join only, samples still to train this epoch over all ranks.
    """
    budget: Budget
    buffer_size: int
    stream: Iterator[PlannedSample]
    rank: int = 0
    over_budget: str = "singleton"
    quota: Optional[int] = None
    shuffle_seed: Optional[int] = None
    buffer: List[PlannedSample] = field(default_factory=list)
    exhausted: bool = False
    finished: bool = False
    round: int = 0
    _pending: List[List[PlannedSample]] = field(default_factory=list)
    _stats: Optional[RoundStats] = None
    _over_budget: int = 0

    def begin_round(self) -> RankStatus:
        if not self.exhausted:  # the buffer never holds more than buffer_size: wanted >= 0
            wanted, before = self.buffer_size - len(self.buffer), len(self.buffer)
            self.buffer.extend(itertools.islice(self.stream, wanted))
            self.exhausted = len(self.buffer) - before < wanted
        grouping = form_groups(self.buffer, self.budget, self.over_budget)
        self._pending = grouping.groups
        self._over_budget = len(grouping.over_budget)
        return RankStatus(len(grouping.groups), len(self.buffer), self.exhausted)

    def plan_round(self, statuses: Sequence[RankStatus]) -> List[List[SampleCost]]:
        """Meet the common target; returns this rank's per-slot lists of sample costs."""
        target = target_groups(statuses)
        if target == 0:
            self.finished = True
            return []
        seed = None if self.shuffle_seed is None else f"{self.shuffle_seed}:{self.rank}:{self.round}"
        fit = fit_to_target(self._pending, target, self.budget, shuffle_seed=seed)
        self.buffer = fit.recirculated
        self._pending = fit.slots
        # idle_slots is counted in close_round, after a quota may have emptied slots
        self._stats = RoundStats(self.round, target, fit.splits, fit.overflow_groups,
                                 over_budget=self._over_budget)
        return [[s.cost for s in slot] for slot in fit.slots]

    def close_round(self, all_costs: Sequence[Sequence[Sequence[SampleCost]]]) -> RoundResult:
        """Turn the planned slots into final slots, knowing every rank's sample costs."""
        if self.finished or self._stats is None:
            raise RuntimeError("close_round() follows a plan_round() that did not finish the epoch")
        slots = self._pending
        kept = [[len(s) for s in rank_slots] for rank_slots in all_costs]
        if self.quota is not None:
            kept, target = trim_to_quota(kept, self.quota)
            self.quota -= sum(map(sum, kept))
            # Samples past the quota are not trained this epoch (non-join has no per-index
            # guarantee); they are dropped with the rest of the stream.
            slots = [slot[:kept[self.rank][i]] for i, slot in enumerate(slots[:target])]
            if self.quota == 0:
                self.finished = True
                self.buffer = []
        costs = [[list(all_costs[r][p][:kept[r][p]]) for p in range(len(slots))]
                 for r in range(len(all_costs))]
        result = []
        for position, slot in enumerate(slots):
            global_tokens = sum(c.label_tokens for rank in costs for c in rank[position])
            global_samples = sum(len(rank[position]) for rank in costs)
            result.append(Slot(tuple(slot), self.round, position, global_tokens, global_samples,
                               self.budget.group_cost(slot)))
        stats, self._stats = self._stats, None
        stats.idle_slots = sum(1 for s in result if s.is_idle)
        self.round += 1
        return RoundResult(result, costs, stats)
