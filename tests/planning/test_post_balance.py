"""Post-balancing as a layout (planning/post_balance.py): each slot's samples re-dealt across
the ranks, nothing lost, moved to another slot or duplicated; and `samples` mode's simulated
schedule post-balanced as the loader does it (the same samples in the same optimizer steps)."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory import SampleCost
from odb_factory.balance.step_plan import StepBalance
from odb_factory.planning.global_grouping import apply_layout
from odb_factory.planning.grouping import Budget
from odb_factory.planning.post_balance import identity_layout, post_balanced
from odb_factory.simulation.schedules import Schedule, index_array, samples_schedule

PACKED = StepBalance(mode="lpt")


@st.composite
def aligned_steps(draw):
    world, slots = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    return [[[SampleCost(n, n // 2) for n in draw(st.lists(st.integers(1, 900), max_size=5))]
             for _ in range(slots)] for _ in range(world)]


@settings(max_examples=300, deadline=None)
@given(costs=aligned_steps(), mode=st.sampled_from(["lpt", "padded", "min_move"]))
def test_a_balanced_layout_re_deals_each_slot_across_the_ranks_only(costs, mode):
    world, slots = len(costs), len(costs[0])
    layout, plans = post_balanced(identity_layout(costs), costs, StepBalance(mode=mode))
    assert len(plans) == slots and len(layout) == world and all(len(rank) == slots for rank in layout)
    for p in range(slots):
        sources = [src for r in range(world) for src in layout[r][p]]
        assert sorted(sources) == sorted((r, p, i) for r in range(world) for i in range(len(costs[r][p])))
        if plans[p] is None:   # not balanced: as it was
            assert all(layout[r][p] == [(r, p, i) for i in range(len(costs[r][p]))] for r in range(world))


def test_a_slot_whose_long_samples_sit_on_one_rank_is_evened_out():
    costs = [[[SampleCost(800, 400), SampleCost(700, 350)]], [[SampleCost(60, 30), SampleCost(50, 25)]]]
    layout, plans = post_balanced(identity_layout(costs), costs, PACKED)
    tokens = [sum(c.input_tokens for c in slot[0]) for slot in apply_layout(layout, costs)]
    assert plans[0] is not None and sorted(tokens) == [800, 810]   # from 1,500 and 110


def test_samples_mode_schedule_post_balanced_keeps_each_optimizer_steps_samples():
    """Standard's two optimizer steps of 4 micro-steps on 2 ranks, rank 0 holding the long rows
    (two to a packed micro-batch): balanced, each micro-step holds the same samples, dealt so the
    longer rank holds fewer tokens."""
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in np.r_[rng.integers(400, 500, 8), rng.integers(20, 80, 8)]]
    costs = [SampleCost(n, n // 2) for n in lengths]
    steps = [[index_array([i]), index_array([8 + i])] for i in range(8)]      # rank 0 long, rank 1 short
    standard = Schedule("standard", 2, steps, accumulation=4)
    budget = Budget(1024, "packed")
    plain = samples_schedule(standard, costs, budget)
    balanced = samples_schedule(standard, costs, budget, balance=PACKED)
    assert balanced.step_ends == plain.step_ends
    for a, b in zip(plain.steps, balanced.steps):
        assert Counter(np.concatenate(a).tolist()) == Counter(np.concatenate(b).tolist())

    def longest_rank(schedule):
        return sum(max(sum(lengths[i] for i in batch) for batch in step) for step in schedule.steps)
    assert longest_rank(balanced) < 0.8 * longest_rank(plain)
