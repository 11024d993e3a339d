"""bench.sensitivity and the profile variants it regenerates: the bands contain the nominal
figure the report prints, each input moves what it should, and the verdicts follow their rule."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from bench import assumptions, sensitivity as S
from bench import workloads as P
from bench.lab import Lab, evaluate_row, step_model_for
from odb_factory.simulation.step_model import OPTIMIZER_FIXED_S
from bench.tables import speedup

MFU = 0.8


@pytest.mark.parametrize("family", P.FAMILIES)
@pytest.mark.parametrize("make,cv,mean", [(P.ultrachat, 0.48, 1350), (P.sharegpt4o, 1.00, 2000)])
def test_every_length_family_keeps_the_profile_mean_and_cv(make, cv, mean, family):
    p = make(6000, seed=1, family=family)
    assert abs(p.cv - cv) < 0.02
    assert abs(p.tokens.mean() / mean - 1) < 0.02


def test_families_differ_in_their_tails_and_mean_scale_moves_the_mean():
    tails = {f: np.quantile(P.ultrachat(6000, seed=1, family=f).tokens, 0.999) for f in P.FAMILIES}
    assert tails["log-logistic"] > tails["lognormal"] > tails["log-gamma"]
    assert P.llava(6000, seed=1, mean_scale=1.15).tokens.mean() == pytest.approx(540 * 1.15, rel=0.02)
    with pytest.raises(ValueError, match="unknown length family 'pareto'"):
        P.ultrachat(10, family="pareto")


def test_pricing_inputs_move_the_step_model_as_stated():
    nominal = S.price("8B", "2n-full", S.Inputs(MFU))
    ref = step_model_for("8B", "2n-full", MFU)
    assert (nominal.a, nominal.c0, nominal.comm_micro_s, nominal.optimizer_s) == \
        (ref.a, ref.c0, ref.comm_micro_s, ref.optimizer_s)
    slow_net = S.price("8B", "2n-full", S.Inputs(MFU, bandwidth=0.5))
    assert slow_net.comm_micro_s == pytest.approx(2 * ref.comm_micro_s)
    assert slow_net.comm_opt_s == pytest.approx(2 * ref.comm_opt_s)
    heavy = S.price("8B", "2n-full", S.Inputs(MFU, overhead=2.0))
    assert heavy.c0 == pytest.approx(2 * ref.c0) and heavy.idle_s == pytest.approx(2 * ref.idle_s)
    assert heavy.optimizer_s == pytest.approx(ref.optimizer_s + OPTIMIZER_FIXED_S)
    faster = S.price("8B", "2n-full", S.Inputs(0.4))
    assert faster.a == pytest.approx(ref.a * MFU / 0.4)


def test_grid_is_every_combination_with_the_nominal_in_it():
    grid = S.pricing_grid(MFU)
    assert len(grid) == 27 == len(set(grid))
    assert S.Inputs(MFU) in grid
    assert {x.mfu for x in grid} == {assumptions.MFU.low, MFU, assumptions.MFU.high}


@pytest.mark.parametrize("low,high,theirs,expected", [
    (1.72, 1.82, 1.77, "matches, robust"),         # width 0.10 < 0.27, all within ±15%
    (1.48, 1.90, 1.73, "not informative"),          # width 0.42 > 0.26
    (2.60, 2.70, 1.77, "misses, robust"),
    (1.95, 2.10, 1.77, "straddles"),                # 1.95 within (≤ 2.04), 2.10 outside
])
def test_verdicts_follow_their_rule(low, high, theirs, expected):
    assert S.verdict(low, high, theirs) == expected


@pytest.fixture(scope="module")
def swept():
    n = 1200
    profiles = {"UltraChat-200K": P.ultrachat(n, 0), "MM-Mix": P.mm_mix(n, 0)}
    lab = Lab(0)
    rows = [("UltraChat-200K", "8B", "1n-full"), ("MM-Mix", "2B", "2n-full")]
    evaluated = {r: evaluate_row(lab, profiles[r[0]], r[1], r[2], MFU) for r in rows}
    regenerate = {"UltraChat-200K": functools.partial(P.ultrachat, n, 0),
                  "MM-Mix": functools.partial(P.mm_mix, n, 0)}
    records = S.sweep(profiles, regenerate, rows, MFU, nominal_lab=lab)
    return evaluated, {(r["workload"], r["model"], r["setting"], r["method"]): r for r in records}


def test_the_nominal_point_is_the_report_figure_and_lies_in_its_band(swept):
    evaluated, records = swept
    for (workload, model, setting), row in evaluated.items():
        rec = records[(workload, model, setting, "odb")]
        assert rec["nominal"] == pytest.approx(speedup(row, "odb"), rel=1e-12)
        assert rec["low"] <= rec["nominal"] <= rec["high"]
        assert rec["low"] < rec["high"]      # the inputs do move it
        for name in S.INPUTS:
            if rec[f"{name}_low"] is not None:
                assert rec["low"] <= rec[f"{name}_low"] <= rec["nominal"] <= rec[f"{name}_high"] <= rec["high"]


def test_variants_counted_and_synthetic_rows_marked(swept):
    _, records = swept
    text = records[("UltraChat-200K", "8B", "1n-full", "odb")]
    mix = records[("MM-Mix", "2B", "2n-full", "odb")]
    # 27 pricings x (nominal + 2 families + 2 means); MM-Mix has no mean input
    assert text["combinations"] == 27 * 5 and mix["combinations"] == 27 * 3
    assert mix["mean_low"] is None and mix["family_low"] is not None
    assert mix["synthetic"] and not text["synthetic"]
    assert text["paper"] == 1.77 and mix["paper"] == 4.43
    assert records[("UltraChat-200K", "8B", "1n-full", "standard")]["low"] == pytest.approx(1.0)


def test_section_counts_only_public_figures(swept, tmp_path):
    _, records = swept
    md = S.section(list(records.values()), tmp_path)
    assert (tmp_path / "sensitivity.csv").read_text().count("\n") == len(records) + 1
    assert "Of the 1 paper figures on public workloads" in md
    assert "MM-Mix (synthetic)" in md and "Synthetic, not counted: MM-Mix 2B" in md
