"""Post-balancing mechanism: re-deal each aligned step's samples across ranks.

Plans come from `balance/step_plan.py` (pure, identical on every rank); this file moves
the pre-collate samples (token ids, labels, media paths: small) so that each lands on the
rank that will collate and train it. Loss weights and ledgers follow the samples.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence

from ..cost import SampleCost
from ..planning.grouping import Budget, PlannedSample
from ..balance.step_plan import StepBalance, moves_by_source, plan_step
from ..planning.rounds import Slot
from ..comm.object_exchange import exchange_objects
from ..comm.channel import SyncChannel


@dataclass
class RebalancedRound:
    slots: List[Slot]               # this rank's slots after the exchange (same count)
    sent_uids: List[Any]            # payloads that left this rank
    received: Dict[Any, Any]        # payloads that arrived, by their new uid
    metrics: Dict[str, float]


class StepRebalancer:
    def __init__(self, sync: SyncChannel, spec: StepBalance, budget: Budget):
        self.sync = sync
        self.spec = spec
        self.budget = budget
        self._uids = itertools.count(start=-1, step=-1)  # received samples: uids never used locally

    def node_of(self, rank: int) -> int:
        return rank // self.spec.ranks_per_node

    def rebalance(self, slots: List[Slot], all_costs: Sequence[Sequence[Sequence[SampleCost]]],
                  payload_of: Callable[[Any], Any], epoch: int) -> RebalancedRound:
        """New slots for this rank (same count, same global token counts), the payloads
        that moved, and the round's balance metrics."""
        me, world = self.sync.rank, self.sync.world_size
        started = time.perf_counter()
        plans = [plan_step([all_costs[r][p] for r in range(world)], self.spec) for p in range(len(slots))]
        planning_s = time.perf_counter() - started
        outgoing: List[List[Any]] = [[] for _ in range(world)]
        sent_uids = []
        for p, plan in enumerate(plans):
            if plan is None:
                continue
            for pos, dest, order in moves_by_source(plan, me):
                sample = slots[p].samples[pos]
                outgoing[dest].append((p, order, sample.index, sample.cost, payload_of(sample.uid)))
                sent_uids.append(sample.uid)
        round_no = slots[0].round if slots else -1
        incoming, sent = exchange_objects(self.sync, outgoing, "balance", epoch, round_no)
        received = {(p, order): (index, cost, payload)
                    for items in incoming for (p, order, index, cost, payload) in items}
        new_slots, arrived = [], {}
        for p, (slot, plan) in enumerate(zip(slots, plans)):
            if plan is None:
                new_slots.append(slot)
                continue
            samples = []
            for order, (src, pos) in enumerate(plan.destinations[me]):
                if src == me:
                    samples.append(slot.samples[pos])
                else:
                    index, cost, payload = received.pop((p, order))
                    uid = next(self._uids)
                    arrived[uid] = payload
                    samples.append(PlannedSample(uid, index, cost))
            new_slots.append(Slot(tuple(samples), slot.round, slot.position, slot.global_label_tokens,
                                  slot.global_samples, self.budget.group_cost(samples)))
        if received:
            raise RuntimeError(f"rank {me}: {len(received)} received samples have no place in the plan")
        balanced = [p for p in plans if p is not None]
        intra = sum(b for d, b in enumerate(sent) if self.node_of(d) == self.node_of(me))
        metrics = {
            "balance_max_over_lb_before": _mean(max(p.cost_before) / p.lower_bound if p.lower_bound else 1.0
                                                for p in balanced),
            "balance_max_over_lb": _mean(p.max_over_lb for p in balanced),
            "balance_bytes_intra_node": float(intra),
            "balance_bytes_inter_node": float(sum(sent) - intra),
            "balance_unbalanced_steps": float(len(plans) - len(balanced)),
            "balance_planning_s": planning_s,
        }
        return RebalancedRound(new_slots, sent_uids, arrived, metrics)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 1.0
