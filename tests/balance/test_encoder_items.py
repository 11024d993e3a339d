"""assign_items (balance/encoder_plan.py), the encoder stages' item assignment: each item's
encoding rank is where balance() sends it, with every option the stage was given, unless the
plan leaves the slowest rank no faster; then every item stays with its owner."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory.balance import balance
from odb_factory.balance.encoder_plan import assign_items


def _expected(costs, sizes, **options):
    """Where balance() sends each item, or its owner when the slowest rank gains nothing."""
    plan = balance(costs, sizes_per_rank=sizes, **options)
    rank_of = {item: dest for dest, items in enumerate(plan.destinations) for item in items}
    loads = [0.0] * len(costs)
    for (owner, i), dest in rank_of.items():
        loads[dest] += costs[owner][i]
    if max(loads) >= max(math.fsum(c) for c in costs):
        return [[owner] * len(c) for owner, c in enumerate(costs)]
    return [[rank_of[(owner, i)] for i in range(len(c))] for owner, c in enumerate(costs)]


@st.composite
def items(draw):
    world = draw(st.integers(2, 6))
    costs = [draw(st.lists(st.integers(1, 50).map(float), max_size=5)) for _ in range(world)]
    sizes = [[float(draw(st.integers(1, 1000))) for _ in c] for c in costs]
    if not any(costs):
        costs[0], sizes[0] = [1.0], [1.0]
    return costs, sizes


@settings(max_examples=300)
@given(items(), st.sampled_from([1, 2, 8]), st.sampled_from(["lpt", "min_move"]),
       st.sampled_from([None, 0.05, 0.5]), st.sampled_from([None, "naive", "assignment"]))
def test_each_item_goes_where_balance_sends_it_with_every_option(case, ranks_per_node, mode, tolerance,
                                                                 placement):
    costs, sizes = case
    # a tolerance is min_move's, a placement LPT's
    options = dict(ranks_per_node=ranks_per_node, mode=mode, tolerance=tolerance if mode == "min_move" else None,
                   placement=placement if mode == "lpt" else None)
    assert assign_items(costs, sizes, **options) == _expected(costs, sizes, **options)


def test_the_options_change_the_assignment():
    """So the property above would notice an option left out: each one, changed alone,
    changes some assignment of these cases."""
    costs = [[2.0, 7.0, 5.0], [1.0], [1.0], [3.0]]
    sizes = [[641.0, 24.0, 304.0], [181.0], [50.0], [635.0]]
    base = dict(ranks_per_node=2, mode="lpt", tolerance=None, placement=None)

    def with_(**change):
        return assign_items(costs, sizes, **{**base, **change})
    assert with_(ranks_per_node=1) != with_()
    assert with_(placement="naive") != with_()
    moves = dict(mode="min_move", placement=None)
    assert with_(**moves, tolerance=0.5) != with_(**moves)


def test_a_plan_that_only_ties_the_slowest_rank_moves_nothing():
    """Ranks of 5 and 5 + 1: LPT moves the 1 to rank 0 (6 | 5 instead of 5 | 6), the slowest
    rank is no faster, so every item stays where it is."""
    assert assign_items([[5.0], [5.0, 1.0]], [[1.0], [1.0, 1.0]], ranks_per_node=8, mode="lpt",
                        tolerance=None, placement=None) == [[0], [1, 1]]
