"""Validation and flattening of the balance planners' per-rank inputs, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from odb_factory.balance.caps import Caps
from odb_factory.balance.inputs import flatten, positive_int


def test_flatten_numbers_samples_by_source_rank_and_position_in_float64():
    s = flatten([[3, 1], [], [2]], sizes_per_rank=[[5, 6], [], [7]], lengths_per_rank=[[30, 10], [], [20]])
    assert s.num_ranks == 3 and s.n == 3
    assert s.src.tolist() == [0, 0, 2] and s.pos.tolist() == [0, 1, 0]
    assert s.cost.tolist() == [3.0, 1.0, 2.0] and s.size.tolist() == [5.0, 6.0, 7.0]
    assert s.length.tolist() == [30.0, 10.0, 20.0]
    assert all(a.dtype == np.float64 for a in (s.cost, s.size, s.length))   # ints given
    assert s.src.dtype == s.pos.dtype == np.int64
    assert flatten([[1.0]]).size.tolist() == [1.0] and flatten([[1.0]]).length is None


def test_a_negative_zero_cost_is_stored_as_zero():
    cost = flatten([[-0.0, 1.0]]).cost
    assert not np.signbit(cost[0]) and cost.tobytes() == np.asarray([0.0, 1.0]).tobytes()


@pytest.mark.parametrize("costs, message", [
    ([], "costs_per_rank must have at least one rank"),
    ([["a"]], r"costs_per_rank\[0\] must be a sequence of numbers: could not convert"),
    ([[1.0], [[1.0, 2.0]]], r"costs_per_rank\[1\] must be one-dimensional, got shape \(1, 2\)"),
    ([[1.0, -2.0]], r"costs_per_rank\[0\]\[1\] = -2.0: values must be finite and non-negative"),
    ("12", "costs_per_rank must be a list with one list of numbers per rank"),
])
def test_bad_costs_name_the_rank_and_position(costs, message):
    with pytest.raises(ValueError, match=message):
        flatten(costs)


def test_sizes_and_lengths_must_match_the_costs():
    with pytest.raises(ValueError, match=r"sizes_per_rank has 1 ranks but costs_per_rank has 2"):
        flatten([[1.0], [2.0]], sizes_per_rank=[[1.0]])
    with pytest.raises(ValueError, match=r"lengths_per_rank\[1\] has 2 entries but costs_per_rank\[1\] has 1"):
        flatten([[1.0], [2.0]], lengths_per_rank=[[1.0], [1.0, 2.0]])


@pytest.mark.parametrize("value", [True, False, 0, 1.5, -3, "3", None])
def test_positive_int_refuses_what_is_not_a_count(value):
    with pytest.raises(ValueError, match=rf"max_samples_per_rank must be an integer >= 1, got {value!r}"):
        positive_int(value, "max_samples_per_rank")


def test_positive_int_takes_integral_numbers():
    assert [positive_int(v, "n") for v in (1, 4.0, np.int64(7))] == [1, 4, 7]
    assert all(type(positive_int(v, "n")) is int for v in (4.0, np.int64(7)))


def test_caps_name_the_option_at_fault():
    with pytest.raises(ValueError, match=r"^max_samples_per_rank must be an integer >= 1, got 0$"):
        Caps.build(0, None, have_lengths=False)
    with pytest.raises(ValueError, match=r"^max_padded_tokens_per_rank needs lengths_per_rank$"):
        Caps.build(None, 64.0, have_lengths=False)
    assert Caps.build(2, 64, have_lengths=True) == Caps(2, 64.0)
