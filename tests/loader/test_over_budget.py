"""Samples over the token budget on their own: trained alone, counted (`over_budget`, logged as
`odb/over_budget_samples`) and warned about once per run, in both step modes; refused by name
with `over_budget: error`."""

from __future__ import annotations

import logging

import pytest

from odb_factory import ODBConfig, ODBDataLoader
from odb_factory.planning.grouping import OverBudgetError
from odb_factory.synthetic import LengthDataset, pad_collate

BUDGET = 64
LENGTHS = [10, 70, 20, 90, 15, 30, 200, 12, 8, 25, 66, 40]   # 70, 90, 200, 66 exceed 64 alone
OVER = sum(n > BUDGET for n in LENGTHS)


def _config(step_mode, **extra):
    values = dict(token_budget=BUDGET, buffer_size=6, gradient_accumulation_steps=2, seed=0, step_mode=step_mode,
                  loss_scaling="micro_mean" if step_mode == "samples" else "exact", standard_batch_size=3,
                  pad_epoch_to_accumulation=True)
    return ODBConfig(**{**values, **extra})


@pytest.mark.parametrize("step_mode", ["groups", "samples"])
def test_over_budget_samples_train_alone_are_counted_and_warned_once(step_mode, caplog):
    loader = ODBDataLoader(LengthDataset(LENGTHS), _config(step_mode), collate_fn=pad_collate)
    try:
        with caplog.at_level(logging.WARNING, logger="odb_factory"):
            steps = list(loader)
    finally:
        loader.close()
    alone = [s.indices for s in steps if any(LENGTHS[i] > BUDGET for i in s.indices)]
    assert all(len(indices) == 1 for indices in alone)          # each over-budget sample alone
    trained = [i for s in steps for i in s.indices]
    assert sum(LENGTHS[i] > BUDGET for i in trained) == OVER     # (samples mode: no wrap-around of these)
    assert loader.metrics.summary()["over_budget"] == OVER
    assert sum(s.metrics.get("over_budget", 0.0) for s in steps) == OVER
    warnings = [r.getMessage() for r in caplog.records if "on their own and train alone" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "ODBConfig.token_budget (YAML key odb_token_budget)" in warnings[0]
    assert "odb_over_budget: error" in warnings[0]


@pytest.mark.parametrize("step_mode", ["groups", "samples"])
def test_over_budget_error_names_the_sample_and_both_keys(step_mode):
    loader = ODBDataLoader(LengthDataset(LENGTHS), _config(step_mode, over_budget="error"), collate_fn=pad_collate)
    try:
        with pytest.raises(OverBudgetError, match=r"sample \d+ costs \d+ tokens .* over the token budget 64; raise "
                                                  r"ODBConfig\.token_budget \(YAML key odb_token_budget\), .* set "
                                                  r"ODBConfig\.over_budget \(YAML key odb_over_budget\) to 'singleton'"):
            list(loader)
    finally:
        loader.close()
