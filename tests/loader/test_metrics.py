"""LoaderMetrics: each step's logged values and the run's totals are exactly what the plans
say, round-level figures are counted once a round, and the over-budget warning comes once."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory.loader.metrics import COUNTERS, LoaderMetrics
from odb_factory.loader.planner_thread import StepPlan


def _plan(indices=(3, 5), input_tokens=30, padded_tokens=40, label_tokens=12, is_idle=False, round_stats=None,
          epoch=0, round=2):
    return StepPlan(epoch=epoch, step=0, round=round, samples=[], indices=list(indices), is_idle=is_idle,
                    label_tokens=label_tokens, input_tokens=input_tokens, padded_tokens=padded_tokens,
                    vision_patches=0, audio_frames=0, global_label_tokens=label_tokens, global_num_samples=2,
                    round_stats=dict(round_stats or {}))


def test_a_step_reports_its_plan():
    step = LoaderMetrics().record(_plan(round_stats={"splits": 1.0, "groups_per_round": 4.0}), wait_s=0.25)
    assert step == {"samples": 2.0, "input_tokens": 30.0, "padded_tokens": 40.0, "label_tokens": 12.0,
                    "padding_efficiency": 0.75, "idle": 0.0, "data_wait_s": 0.25, "splits": 1.0,
                    "groups_per_round": 4.0}
    assert all(type(v) is float for v in step.values())


def test_an_idle_step_has_no_padding_efficiency_and_counts_as_idle():
    metrics = LoaderMetrics()
    step = metrics.record(_plan(indices=(), input_tokens=0, padded_tokens=0, label_tokens=0, is_idle=True), 0.0)
    assert step["padding_efficiency"] == 0.0 and step["idle"] == 1.0 and step["samples"] == 0.0
    assert metrics.summary()["idle_steps"] == 1.0 and metrics.summary()["padding_efficiency"] == 0.0


plans = st.builds(
    _plan,
    indices=st.lists(st.integers(0, 99), max_size=5),
    input_tokens=st.integers(0, 500), padded_tokens=st.integers(0, 800), label_tokens=st.integers(0, 500),
    is_idle=st.booleans(), epoch=st.integers(0, 2),
    round_stats=st.one_of(
        st.just({}),
        st.fixed_dictionaries({"over_budget": st.integers(0, 3).map(float)}),
        st.fixed_dictionaries({"groups_per_round": st.integers(1, 8).map(float),
                               "splits": st.integers(0, 3).map(float),
                               "overflow_groups": st.integers(0, 3).map(float),
                               "over_budget": st.integers(0, 3).map(float)}),
        st.fixed_dictionaries({"moved_samples": st.integers(0, 3).map(float)})))


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(plans, st.floats(0, 2)), max_size=12))
def test_totals_are_the_sums_of_the_steps(steps):
    metrics = LoaderMetrics()
    logged = [metrics.record(plan, wait) for plan, wait in steps]
    total = metrics.summary()
    assert set(COUNTERS) <= set(total)
    assert total["steps"] == len(steps)
    for key in ("samples", "input_tokens", "padded_tokens", "label_tokens", "data_wait_s"):
        assert total[key] == pytest.approx(sum(s[key] for s in logged))
    assert total["idle_steps"] == sum(plan.is_idle for plan, _ in steps)
    assert total["over_budget"] == sum(plan.round_stats.get("over_budget", 0.0) for plan, _ in steps)
    # a round is a step whose plan carries round figures beyond the over-budget count
    rounds = [plan.round_stats for plan, _ in steps if set(plan.round_stats) - {"over_budget"}]
    assert total["rounds"] == len(rounds)
    for key in ("splits", "overflow_groups"):
        assert total[key] == sum(r.get(key, 0.0) for r in rounds)
    padded = total["padded_tokens"]
    assert total["padding_efficiency"] == (total["input_tokens"] / padded if padded else 0.0)
    epochs = [plan.epoch for plan, _ in steps]
    assert metrics.epoch_steps == {e: epochs.count(e) for e in set(epochs)}


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("stats, unit", [({"over_budget": 2.0}, "step"),
                                         ({"over_budget": 2.0, "splits": 0.0}, "round")])
def test_over_budget_warns_once_with_count_place_and_keys(caplog, stats, unit):
    metrics = LoaderMetrics()
    with caplog.at_level(logging.WARNING, logger="odb_factory"):
        metrics.record(_plan(round_stats={}), 0.0)
        assert _warnings(caplog) == []
        metrics.record(_plan(round_stats=stats, epoch=1, round=7), 0.0)
        metrics.record(_plan(round_stats={"over_budget": 3.0}), 0.0)
    assert _warnings(caplog) == [
        "ODB: 2 sample(s) of this rank cost more than ODBConfig.token_budget (YAML key odb_token_budget) on "
        f"their own and train alone (epoch 1, {unit} 7); each is counted in odb/over_budget_samples. Raise the budget, lower "
        "cutoff_len or the image resolution, or set odb_over_budget: error to refuse them"]
    assert metrics.summary()["over_budget"] == 5.0
