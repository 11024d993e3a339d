"""Re-layout mechanism: global grouping and post-balancing of each aligned round.

Plans come from `planning/global_grouping.py` and `planning/post_balance.py` (pure, identical on
every rank); this file moves the pre-collate samples (token ids, labels, media paths: small)
so that each lands on the rank that will collate and train it. Loss weights and ledgers
follow the samples.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..cost import SampleCost
from ..planning.grouping import Budget, PlannedSample
from ..balance.step_plan import StepBalance
from ..planning.global_grouping import Layout, apply_layout, regroup_round
from ..planning.post_balance import identity_layout, post_balanced
from ..planning.rounds import Slot
from ..comm.object_exchange import exchange_objects
from ..comm.channel import SyncChannel


@dataclass
class RebalancedRound:
    slots: List[Slot]               # this rank's slots after the exchange (as many, or fewer:
                                    # packed global grouping may need fewer steps)
    sent_uids: List[Any]            # payloads that left this rank
    received: Dict[Any, Any]        # payloads that arrived, by their new uid
    metrics: Dict[str, float]


class StepRebalancer:
    """Re-lays out an aligned round (groups mode) or optimizer step (samples mode): global
    grouping (`planning/global_grouping.py`) re-forms its groups over every rank's samples,
    post-balancing (`balance/step_plan.py`) re-deals each step's samples across ranks; one
    exchange moves the samples that change rank."""

    def __init__(self, sync: SyncChannel, spec: Optional[StepBalance], budget: Budget,
                 global_grouping: bool = False, seed: str = "", ranks_per_node: int = 1):
        self.sync = sync
        self.spec = spec
        self.budget = budget
        self.global_grouping = global_grouping
        self.seed = seed
        self.ranks_per_node = ranks_per_node
        self._uids = itertools.count(start=-1, step=-1)  # received samples: uids never used locally

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def plan(self, all_costs: Sequence[Sequence[Sequence[SampleCost]]], round_no: int,
             epoch: int) -> Tuple[Layout, Dict[str, float]]:
        """The layout every rank computes from the gathered costs, and its figures."""
        layout: Layout = identity_layout(all_costs)
        metrics: Dict[str, float] = {}
        started = time.perf_counter()
        if self.global_grouping:
            regrouped = regroup_round(all_costs, self.budget, self.ranks_per_node,
                                      seed=f"{self.seed}:{epoch}:{round_no}")
            metrics["global_grouping_rounds"] = float(regrouped is not None)
            layout = regrouped or layout
        if self.spec is not None:
            layout, plans = post_balanced(layout, all_costs, self.spec)
            balanced = [p for p in plans if p is not None]
            metrics.update({
                "balance_max_over_lb_before": _mean(max(p.cost_before) / p.lower_bound if p.lower_bound else 1.0
                                                    for p in balanced),
                "balance_max_over_lb": _mean(p.max_over_lb for p in balanced),
                "balance_unbalanced_steps": float(len(plans) - len(balanced))})
        metrics["balance_planning_s"] = time.perf_counter() - started
        return layout, metrics

    def rebalance(self, slots: List[Slot], all_costs: Sequence[Sequence[Sequence[SampleCost]]],
                  payload_of: Callable[[Any], Any], epoch: int, step_totals: bool = False) -> RebalancedRound:
        """New slots for this rank (as many as the layout has: global grouping may need fewer),
        the payloads that moved, and the figures. `slots`: this rank's slots of one round or
        optimizer step, at least one (every rank holds as many, IDLE slots included).
        step_totals: every slot carries its optimizer step's global counts (samples mode),
        which a re-layout within the step leaves unchanged; otherwise each slot's are recounted."""
        me, world = self.sync.rank, self.sync.world_size
        round_no = slots[0].round
        layout, metrics = self.plan(all_costs, round_no, epoch)
        outgoing: List[List[Any]] = [[] for _ in range(world)]
        sent_uids = []
        for dest in range(world):
            for q, sources in enumerate(layout[dest]):
                for order, (src, p, pos) in enumerate(sources):
                    if src == me and dest != me:
                        sample = slots[p].samples[pos]
                        outgoing[dest].append((q, order, sample.index, sample.cost, payload_of(sample.uid)))
                        sent_uids.append(sample.uid)
        incoming, sent = exchange_objects(self.sync, outgoing, "balance", epoch, round_no)
        received = {(q, order): (index, cost, payload)
                    for items in incoming for (q, order, index, cost, payload) in items}
        costs = apply_layout(layout, all_costs)
        new_slots, arrived = [], {}
        for q, (slot, sources) in enumerate(zip(slots, layout[me])):
            samples = []
            for order, (src, p, pos) in enumerate(sources):
                if src == me:
                    samples.append(slots[p].samples[pos])
                else:
                    index, cost, payload = received.pop((q, order))
                    uid = next(self._uids)
                    arrived[uid] = payload
                    samples.append(PlannedSample(uid, index, cost))
            if step_totals:
                label_tokens, num_samples = slot.global_label_tokens, slot.global_samples
            else:
                label_tokens = sum(c.label_tokens for rank in costs for c in rank[q])
                num_samples = sum(len(rank[q]) for rank in costs)
            new_slots.append(Slot(tuple(samples), slot.round, slot.position, label_tokens, num_samples,
                                  self.budget.group_cost(samples)))
        if received:
            raise RuntimeError(f"rank {me}: {len(received)} received samples have no place in the plan")
        intra = sum(b for d, b in enumerate(sent) if self.node_of(d) == self.node_of(me))
        metrics.update({"balance_bytes_intra_node": float(intra),
                        "balance_bytes_inter_node": float(sum(sent) - intra)})
        return RebalancedRound(new_slots, sent_uids, arrived, metrics)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 1.0
