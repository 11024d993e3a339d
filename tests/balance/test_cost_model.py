"""StageCostModel, the Qwen3-VL defaults and fit_stage_cost_model (scipy nnls)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory.balance import (QWEN3_VL_LLM, QWEN3_VL_VISION, StageCostModel, balance,
                                 fit_stage_cost_model)


def test_call_is_vectorised_and_matches_the_formula():
    model = StageCostModel(c0=2.0, a=3.0, b=0.5)
    lengths = np.array([0.0, 1.0, 10.0, 1000.0])
    np.testing.assert_allclose(model(lengths), 2.0 + 3.0 * lengths + 0.5 * lengths**2)
    assert type(model(4)) is float and model(4) == 2.0 + 12.0 + 8.0  # a Python float, not numpy's
    assert model([[1, 2], [3, 4]]).shape == (2, 2)


@pytest.mark.parametrize("kwargs", [dict(c0=-1.0), dict(a=float("nan")), dict(b=float("inf")),
                                    dict(a="1"), dict(b=True)])
def test_invalid_coefficients_raise(kwargs):
    with pytest.raises(ValueError, match="StageCostModel"):
        StageCostModel(**kwargs)


@pytest.mark.parametrize("model", [QWEN3_VL_LLM, QWEN3_VL_VISION])
def test_defaults_are_monotone_and_attention_matters_only_at_long_lengths(model):
    lengths = np.arange(0, 200_000, 997, dtype=float)
    assert np.all(np.diff(model(lengths)) > 0)
    crossover = model.a / model.b  # length where attention FLOPs equal the dense FLOPs
    assert 1_000 < crossover < 100_000


def test_vision_tokens_are_cheaper_than_llm_tokens():
    # Relative units: one LLM token = 1. A ~0.4B-param ViT costs a small fraction per patch.
    assert QWEN3_VL_LLM(1.0) == pytest.approx(1.0, rel=1e-3)
    assert 0.01 < QWEN3_VL_VISION(1.0) < 0.2


def _coefficient(high):
    # zero, or a magnitude a cost model can have (subnormal floats give times near 1e-320,
    # where relative errors say nothing about the fit)
    return st.one_of(st.just(0.0), st.floats(1e-12, high))


@settings(max_examples=100, deadline=None)
@given(_coefficient(100), _coefficient(10), _coefficient(0.01),
       st.lists(st.integers(1, 20_000), min_size=3, max_size=40, unique=True))
def test_fit_recovers_an_exact_model(c0, a, b, lengths):
    true = StageCostModel(c0, a, b)
    times = true(np.array(lengths, dtype=float))
    fit = fit_stage_cost_model(lengths, times)
    assert min(fit.model.c0, fit.model.a, fit.model.b) >= 0
    np.testing.assert_allclose(fit.model(np.array(lengths, float)), times,
                               rtol=1e-6, atol=1e-6 * (1.0 + float(np.max(times))))
    assert fit.r2 >= 1 - 1e-6
    assert fit.mean_rel_error <= 1e-4


def test_fit_with_noise_reports_quality():
    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 32_768, 400)
    true = StageCostModel(5.0, 1.0, 2e-5)
    times = true(lengths) * rng.normal(1.0, 0.05, lengths.shape[0])
    model, r2, mre = fit_stage_cost_model(lengths, times)
    assert 0.95 < r2 <= 1.0
    assert 0.01 < mre < 0.08
    assert model.a == pytest.approx(1.0, rel=0.1)
    assert model.b == pytest.approx(2e-5, rel=0.2)


def test_fit_never_returns_negative_coefficients():
    lengths = np.arange(1, 50, dtype=float)
    fit = fit_stage_cost_model(lengths, 100.0 - lengths)  # decreasing: no valid model fits
    assert min(fit.model.c0, fit.model.a, fit.model.b) >= 0
    assert fit.r2 < 0.5


def test_fit_constant_times():
    fit = fit_stage_cost_model([0, 0, 0], [2.0, 2.0, 2.0])
    assert fit.model(0.0) == pytest.approx(2.0) and fit.r2 == 1.0


@pytest.mark.parametrize("lengths, times, match", [
    ([1, 2], [1.0], "lengths has 2 entries but times has 1"),
    ([], [], "at least one"),
    ([1, 2], [1.0, -1.0], "times must be finite and non-negative"),
    ([1, float("nan")], [1.0, 1.0], "lengths must be finite"),
])
def test_fit_rejects_bad_input(lengths, times, match):
    with pytest.raises(ValueError, match=match):
        fit_stage_cost_model(lengths, times)


def test_padded_balance_with_the_llm_model_uses_the_longest_sample_per_rank():
    lengths = [[8192, 100, 100, 100], [4096], [], [2048, 2048]]
    costs = [[1.0] * len(r) for r in lengths]
    plan = balance(costs, 8, "padded", lengths_per_rank=lengths, cost_model=QWEN3_VL_LLM)
    for dest, cost in zip(plan.destinations, plan.cost_per_rank):
        longest = max((lengths[r][p] for r, p in dest), default=None)
        assert cost == (0.0 if longest is None else len(dest) * QWEN3_VL_LLM(longest))
    assert plan.cost_per_rank.count(QWEN3_VL_LLM(8192)) == 1  # the longest sample runs alone
