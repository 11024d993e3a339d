"""Validation and flattening of the balance planners' per-rank inputs, by hand."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from odb_factory.balance import balance
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
    with pytest.raises(ValueError, match=r"^token_budget needs lengths_per_rank$"):
        Caps.build(None, 64.0, have_lengths=False)
    assert Caps.build(2, 64, have_lengths=True) == Caps(2, 64.0)


# ------------------------------------------------------------------ cost_model (mode="padded")

@pytest.mark.parametrize("kw, message", [
    (dict(mode="lpt", lengths_per_rank=[[3, 1]]), "cost_model is only used by mode='padded'"),
    (dict(mode="padded"), "cost_model needs lengths_per_rank"),
])
def test_cost_model_misuse_is_named(kw, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        balance([[1.0, 1.0]], 8, cost_model=lambda lengths: lengths, **kw)


@pytest.mark.parametrize("model", [
    lambda lengths: lengths[:-1],                                   # one cost short (shape alone)
    lambda lengths: -lengths,                                       # negative (values alone)
    lambda lengths: np.where(lengths > 2, np.inf, lengths),         # infinite, yet >= 0
    lambda lengths: np.where(lengths > 2, np.nan, lengths),
])
def test_a_cost_model_of_the_wrong_shape_or_values_is_refused(model):
    with pytest.raises(ValueError, match=r"^cost_model must map lengths to finite non-negative costs, elementwise$"):
        balance([[1.0, 1.0], [1.0]], 8, "padded", lengths_per_rank=[[3, 1], [2]], cost_model=model)


def test_a_cost_model_may_return_zeros_a_column_or_a_list():
    """Zero is a cost; any array-like of one cost per length, flattened, is accepted."""
    kw = dict(lengths_per_rank=[[3, 1], [2]])
    zero = balance([[1.0, 1.0], [1.0]], 8, "padded", cost_model=lambda L: np.where(L > 1, L, 0.0), **kw)
    assert zero.cost_before == [6.0, 2.0]
    column = balance([[1.0, 1.0], [1.0]], 8, "padded", cost_model=lambda L: L.reshape(-1, 1) * 2, **kw)
    listed = balance([[1.0, 1.0], [1.0]], 8, "padded", cost_model=lambda L: [2 * x for x in L.tolist()], **kw)
    assert column.cost_before == listed.cost_before == [12.0, 4.0]


def test_a_cost_model_of_negative_zeros_reports_zero_costs():
    plan = balance([[1.0, 1.0], [1.0]], 8, "padded", lengths_per_rank=[[0, 0], [0]],
                   cost_model=lambda L: -0.0 * L)
    assert not any(np.signbit(plan.cost_before + plan.cost_per_rank))


def test_min_move_prices_a_zero_byte_sample_without_a_numpy_warning():
    """A sample of no bytes has the best cost per byte (inf), computed without dividing by 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = balance([[3.0, 3.0, 3.0, 3.0], []], 8, "min_move", sizes_per_rank=[[0.0, 1.0, 1.0, 2.0], []],
                       tolerance=0.0)
    assert sorted(plan.moves)[0] == (0, 0, 1) and plan.target_met
