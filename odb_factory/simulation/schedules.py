"""A whole epoch's batches for a simulated world, and ODB's two ways of forming them.

A `Schedule` is what a batching method decides: for every micro-step, the sample indices each
rank trains (an empty batch is an IDLE slot), and how many micro-steps make one optimizer
step. It says nothing about time; `pricing.evaluate` turns it into seconds with a step model.

ODB's schedules come from the engine's own code: `groups_schedule` runs `simulate_epoch` (the
RankPlanner the loader runs), `samples_schedule` packs a fixed-batch schedule's optimizer steps
with the planner thread's `pack_step` / `align_step`. The benchmark (`bench/methods.py`) and
`python -m odb_factory.dry_run` both build them here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from ..balance.step_plan import StepBalance
from ..config import ODBConfig
from ..cost import SampleCost
from ..planning.global_grouping import apply_layout, regroup_round
from ..planning.grouping import Budget, PlannedSample
from ..planning.optimizer_steps import align_step, pack_step
from ..planning.post_balance import identity_layout, post_balanced
from ..planning.simulated_world import simulate_epoch


@dataclass
class Schedule:
    method: str
    world: int
    steps: List[List[np.ndarray]]     # steps[micro][rank] -> sample indices (empty = IDLE)
    accumulation: int = 1             # micro-steps per optimizer step
    cost_mode: str = "padded"         # "padded" (n * max_len) or "packed" (sum len, varlen)
    expected_samples: Optional[int] = None   # non-join quota: count, not identity
    step_ends: Optional[List[int]] = None     # micro-steps that end an optimizer step, when
                                              # their number varies (ODB samples mode)
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def micro_steps(self) -> int:
        return len(self.steps)

    @property
    def optimizer_steps(self) -> int:
        if self.step_ends is not None:
            return len(self.step_ends)
        return -(-len(self.steps) // self.accumulation)

    def indices(self) -> np.ndarray:
        parts = [b for step in self.steps for b in step if len(b)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def index_array(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def costs_of(samples) -> List[SampleCost]:
    """SampleCosts from per-sample arrays `tokens`, `label_tokens`, `patches`."""
    return [SampleCost(int(t), int(l), int(v)) for t, l, v in
            zip(samples.tokens.tolist(), samples.label_tokens.tolist(), samples.patches.tolist())]


def groups_schedule(costs: Sequence[SampleCost], config: ODBConfig, world: int, name: str = "odb",
                    pad_to_accumulation: bool = False) -> Schedule:
    """`step_mode="groups"`: the planner's epoch for a whole world (`simulate_epoch`).
    `pad_to_accumulation` ends the epoch with IDLE micro-steps up to a full accumulation
    window, as the loader does for trainers that step every N micro-steps."""
    sim = simulate_epoch(costs, config, world)
    steps = [[index_array([s.index for s in sim.slots[r][i].samples]) for r in range(world)]
             for i in range(sim.steps)]
    accumulation = config.gradient_accumulation_steps
    if pad_to_accumulation:
        steps += [[index_array([]) for _ in range(world)] for _ in range(-len(steps) % accumulation)]
    join = "join" if config.join else "non-join"
    return Schedule(name, world, steps, accumulation, config.cost_mode,
                    expected_samples=None if config.join else (config.quota or len(costs)),
                    note=f"L_max={config.token_budget}, B={config.buffer_size}, {join}",
                    extra={"sim": sim})


def samples_schedule(standard: Schedule, costs: Sequence[SampleCost], budget: Budget,
                     over_budget: str = "singleton", name: str = "odb_samples",
                     global_grouping: bool = False, ranks_per_node: int = 1,
                     balance: Optional[StepBalance] = None) -> Schedule:
    """`step_mode="samples"` on a fixed-batch schedule: the same optimizer steps with the same
    samples; each rank packs its share of a step (`pack_step`) and the ranks align their
    micro-batch counts (`align_step`), as the planner thread does; with `global_grouping` the
    step's micro-batches are then re-formed over every rank's share (`regroup_round`), and with
    `balance` each micro-step's samples re-dealt across the ranks (`post_balanced`), as the
    loader's StepRebalancer does."""
    s, steps, ends = standard, [], []
    for start in range(0, len(s.steps), s.accumulation):
        window = s.steps[start:start + s.accumulation]
        shares = [[PlannedSample(int(i), int(i), costs[int(i)]) for micro in window for i in micro[r]]
                  for r in range(s.world)]
        groups = [pack_step(share, budget, over_budget) for share in shares]
        counts = [len(g) for g in groups]
        aligned = [align_step(g, counts, budget) for g in groups]
        if global_grouping and s.world > 1:
            layout = regroup_round([[[x.cost for x in g] for g in rank] for rank in aligned], budget,
                                   ranks_per_node, seed=str(start))
            aligned = apply_layout(layout, aligned) if layout is not None else aligned
        if balance is not None and s.world > 1:
            layout, _ = post_balanced(identity_layout(aligned), [[[x.cost for x in g] for g in rank] for rank in aligned],
                                      balance)
            aligned = apply_layout(layout, aligned)
        steps += [[index_array([x.index for x in aligned[r][m]]) for r in range(s.world)]
                  for m in range(len(aligned[0]))]
        ends.append(len(steps) - 1)
    return Schedule(name, s.world, steps, s.accumulation, budget.cost_mode, step_ends=ends,
                    note=f"{s.note}, packed to L_max={budget.token_budget}", extra={"standard": s.method})
