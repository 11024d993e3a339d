"""Run the alignment protocol for a whole simulated world in one process.

The same RankPlanner code the loader runs, with the all-gathers replaced by lists. Used by
the property tests (any world size, shard shape, cost distribution) and by the benchmarks
to produce every method's batches at paper scale without GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from ..config import ODBConfig
from ..cost import SampleCost
from .global_grouping import regroup_slots
from .grouping import Budget, PlannedSample
from .rounds import RankPlanner, RoundStats, Slot
from .views import cycling_view, epoch_view


class NonTerminationError(RuntimeError):
    """The protocol exceeded its proven round bound (a bug, never expected)."""


def planned_stream(indices: Iterable[int], costs: Sequence[SampleCost]):
    for uid, index in enumerate(indices):
        yield PlannedSample(uid, index, costs[index])


@dataclass
class SimulatedEpoch:
    slots: List[List[Slot]]            # slots[rank][step]
    stats: List[List[RoundStats]]      # stats[rank][round]
    views: List[List[int]]

    @property
    def steps(self) -> int:
        return len(self.slots[0]) if self.slots else 0

    @property
    def rounds(self) -> int:
        return len(self.stats[0]) if self.stats else 0

    def trained_indices(self, rank: Optional[int] = None) -> List[int]:
        ranks = range(len(self.slots)) if rank is None else [rank]
        return [s.index for r in ranks for slot in self.slots[r] for s in slot.samples]


def round_bound(views: Sequence[Sequence[int]], join: bool, quota: Optional[int]) -> int:
    """Rounds the protocol can need (docs/dgap.md): each round every rank holding data
    emits at least one sample, so join needs at most max|view|+1 rounds; non-join emits at
    least one sample per round until the quota closes."""
    return (max((len(v) for v in views), default=0) if join else quota) + 1


def simulate_epoch(costs: Sequence[SampleCost], config: ODBConfig, world_size: int,
                   epoch: int = 0, views: Optional[Sequence[Sequence[int]]] = None) -> SimulatedEpoch:
    """Plan one epoch for `world_size` ranks over a dataset whose sample i costs costs[i]."""
    if views is None:
        views = [epoch_view(len(costs), world_size, r, config.seed, epoch, config.shuffle)
                 for r in range(world_size)]
    views = [list(v) for v in views]
    budget = Budget.from_config(config)
    quota = None if config.join else (config.quota or len(costs))
    planners = []
    for rank, view in enumerate(views):
        order = view if config.join else cycling_view(view, config.seed, epoch, rank)
        planners.append(RankPlanner(budget, config.buffer_size, planned_stream(order, costs),
                                    rank=rank, over_budget=config.over_budget, quota=quota,
                                    shuffle_seed=f"{config.seed}:{epoch}"))
    slots: List[List[Slot]] = [[] for _ in views]
    stats: List[List[RoundStats]] = [[] for _ in views]
    limit = round_bound(views, config.join, quota)
    for _ in range(limit + 1):  # pragma: no mutate, a safety net the property tests prove unused
        statuses = [p.begin_round() for p in planners]
        costs = [p.plan_round(statuses) for p in planners]
        if planners[0].finished:
            break
        results = [p.close_round(costs) for p in planners]
        round_slots = [r.slots for r in results]
        if config.global_grouping and world_size > 1 and round_slots[0]:  # as the loader: one rank has no peers
            round_slots = regroup_slots(round_slots, budget, config.ranks_per_node or world_size,
                                        seed=f"{config.seed}:{epoch}:{results[0].stats.round}")
        for rank, result in enumerate(results):
            slots[rank].extend(round_slots[rank])
            stats[rank].append(result.stats)
        if planners[0].finished:
            break
    else:
        raise NonTerminationError(f"alignment did not finish within {limit} rounds")  # pragma: no mutate
    return SimulatedEpoch(slots, stats, views)
