"""Post-balancing as a layout: each aligned slot's samples re-dealt across the ranks
(`balance/step_plan.plan_step`, OrchMLLM's batch post-balancing), after any global grouping.
Pure: the loader's StepRebalancer moves samples by it, the simulation prices it."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..balance import BalancePlan
from ..balance.step_plan import StepBalance, plan_step
from ..cost import SampleCost
from .global_grouping import Layout, apply_layout


def identity_layout(slots_per_rank: Sequence[Sequence[Sequence]]) -> Layout:
    """Every sample where it is: layout[rank][slot] = its own (rank, slot, position)s."""
    return [[[(r, p, i) for i in range(len(slot))] for p, slot in enumerate(rank)]
            for r, rank in enumerate(slots_per_rank)]


def post_balanced(layout: Layout, all_costs: Sequence[Sequence[Sequence[SampleCost]]],
                  spec: StepBalance) -> Tuple[Layout, List[Optional[BalancePlan]]]:
    """`layout` with each slot's samples (the same slot on every rank) re-dealt by `spec`, and
    each slot's plan (None: it could not be balanced within the caps and stays as it was).
    all_costs[rank][slot]: the costs of the samples the layout's sources point to."""
    world = len(layout)
    costs = apply_layout(layout, all_costs)
    plans = [plan_step([costs[r][p] for r in range(world)], spec) for p in range(len(layout[0]) if world else 0)]
    balanced = [list(rank) for rank in layout]
    for p, plan in enumerate(plans):
        if plan is not None:
            column = [layout[r][p] for r in range(world)]
            for r in range(world):
                balanced[r][p] = [column[src][pos] for src, pos in plan.destinations[r]]
    return balanced, plans
