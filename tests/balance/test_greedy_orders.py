"""The balance planners' orders and float arithmetic against second formulations written here:
a pure-Python LPT, the stable longest-first order, and a brute-force largest multiple."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory.balance import lpt_groups
from odb_factory.balance.caps import Caps, largest_multiple
from odb_factory.balance.padded import padded_groups


def python_lpt(cost, num_ranks):
    """LPT without caps: cost descending, ties by sample id (Python's sort is stable), each
    onto the least-loaded bin, ties by bin id."""
    groups, loads = [[] for _ in range(num_ranks)], [0.0] * num_ranks
    for i in sorted(range(len(cost)), key=lambda i: -cost[i]):
        b = min(range(num_ranks), key=lambda b: (loads[b], b))
        groups[b].append(i)
        loads[b] += float(cost[i])
    return groups


@settings(max_examples=200)
@given(st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=0, max_size=80), st.integers(1, 6))
def test_lpt_with_many_ties_is_the_python_lpt(cost, num_ranks):
    """Few distinct costs, many samples: ties decide most placements (numpy's default sort
    would deal them out of id order past 16 samples)."""
    assert lpt_groups(np.asarray(cost), num_ranks) == python_lpt(cost, num_ranks)


def test_lpt_counts_a_bins_longest_from_zero():
    """Two samples of length 0.5 fit one rank under a 1.0 padded-token cap: 2 * 0.5."""
    groups = lpt_groups(np.asarray([1.0, 1.0]), 1, Caps(token_budget=1.0), length=np.asarray([0.5, 0.5]))
    assert groups == [[0, 1]]


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from([1.0, 2.0]), st.integers(1, 4)), min_size=1, max_size=80),
       st.integers(1, 6), st.booleans())
def test_padded_groups_are_runs_of_the_stable_longest_first_order(rows, num_ranks, by_length):
    """Every rank gets a contiguous run of the samples ordered longest first, ties by id;
    with lengths, the lengths order them (units tie across different lengths)."""
    unit = np.asarray([u for u, _ in rows])
    length = np.asarray([u * 10 + extra for u, extra in rows]) if by_length else None
    key = unit if length is None else length
    order = sorted(range(len(rows)), key=lambda i: -key[i])
    groups = padded_groups(unit, num_ranks, length=length)
    assert [i for g in groups for i in g] == order


def test_padded_groups_order_tied_units_by_length():
    unit, length = np.asarray([16.0] * 4), np.asarray([9, 16, 10, 15])
    assert padded_groups(unit, 2, length=length) == [[1, 3], [2, 0]]
    assert padded_groups(unit, 2) == [[0, 1], [2, 3]]


# ------------------------------------------------------------------ float arithmetic

def brute_largest_multiple(unit, limit, k_max):
    return max(k for k in range(k_max + 1) if k == 0 or k * unit <= limit)


@pytest.mark.parametrize("unit, limit, k_max, expected", [
    (4.910684195971845, 98.21368391943689, 50, 19),   # limit / unit rounds up to 20.0; 20 * unit > limit
    (5.838980606381498, 169.33043758506344, 50, 29),  # limit / unit rounds down below 29; 29 * unit == limit
    (2.0, 7.0, 2, 2), (2.0, 1.0, 9, 0), (0.0, 5.0, 7, 7),
])
def test_largest_multiple_by_hand_where_the_quotient_rounds_the_wrong_way(unit, limit, k_max, expected):
    assert largest_multiple(unit, limit, k_max) == expected == (
        k_max if unit <= 0 else brute_largest_multiple(unit, limit, k_max))


@settings(max_examples=500)
@given(st.floats(0.1, 10.0), st.integers(0, 60), st.integers(-1, 1), st.integers(0, 80))
def test_largest_multiple_is_the_brute_force_one(unit, k, nudge, k_max):
    """Limits one float64 step around a multiple of the unit, where rounding decides."""
    limit = k * unit
    if nudge:
        limit = math.nextafter(limit, math.inf if nudge > 0 else 0.0)
    assert largest_multiple(unit, limit, k_max) == brute_largest_multiple(unit, limit, k_max)


def brute_padded_cost(unit, num_ranks):
    """min over every assignment of samples to ranks of max(count * longest unit)."""
    best = math.inf
    for ranks in itertools.product(range(num_ranks), repeat=len(unit)):
        loads = [0.0] * num_ranks
        for r in range(num_ranks):
            mine = [u for u, owner in zip(unit, ranks) if owner == r]
            loads[r] = len(mine) * max(mine) if mine else 0.0
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("unit, num_ranks", [
    # candidate costs one float64 step apart (2 * 19.38665073400002 is the optimum, and
    # 2 * 19.386650734000025 the next float): the bisection over bit patterns must not step
    # past the optimum's pattern
    ([6.462216911333342, 19.38665073400002, 19.386650734000025, 29.07997610100003], 3),
    ([18.30450716740985, 54.91352150222955, 27.45676075111477, 18.30450716740985, 18.30450716740985], 2),
])
def test_padded_groups_find_the_optimum_one_float_step_below_another_candidate(unit, num_ranks):
    groups = padded_groups(np.asarray(unit), num_ranks)
    cost = max(len(g) * max(unit[i] for i in g) if g else 0.0 for g in groups)
    assert cost == brute_padded_cost(unit, num_ranks)
