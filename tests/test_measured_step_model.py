"""A step model measured on the machine that trains (`python -m odb_factory.dry_run
--step-model`): its file is checked key by key, it prices what the run computes (logits at the
supervised positions where ODB computes only those; ranks that wait for each other at the
optimizer step under DDP, at every micro-step under ZeRO), and the dry run plans with it."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory.simulation.measured import load, measured_step_model
from odb_factory.simulation.pricing import evaluate, features
from odb_factory.simulation.schedules import Schedule
from tests.helpers import lf_runs

GOOD = {"device": "cpu", "ranks": 2, "ranks_meet": "optimizer_step", "c0_s_per_micro_batch": 0.5,
        "a_s_per_token": 1e-3, "b_s_per_token_sq": 1e-7, "head_s_per_logit_position": 3e-3}


def _file(tmp_path, **changes):
    data = {k: v for k, v in {**GOOD, **changes}.items() if v is not None}
    path = tmp_path / "model.json"
    path.write_text(json.dumps(data))
    return path


def test_a_measured_model_prices_with_its_coefficients(tmp_path):
    m = measured_step_model(_file(tmp_path), world=2)
    assert (m.c0, m.a, m.b, m.head, m.idle_s) == (0.5, 1e-3, 1e-7, 3e-3, 0.5)
    assert (m.device, m.ranks_meet, m.world) == ("cpu", "optimizer_step", 2)
    # no vision terms (recipes with images are refused), no collectives or optimizer apart, no memory model
    assert (m.v0, m.va, m.vb, m.comm_micro_s, m.comm_opt_s, m.optimizer_s) == (0, 0, 0, 0, 0, 0)
    assert (m.static_bytes, m.bytes_per_token, m.bytes_per_patch, m.hbm_bytes) == (0, 0, 0, math.inf)
    assert m.ranks_per_node == 2 and m.fits(10 ** 9) and m.name == "measured (model.json)"


@pytest.mark.parametrize("changes, message", [
    ({"a_s_per_token": None}, "missing 'a_s_per_token'"),
    ({"ranks_meet": None}, "missing 'ranks_meet'"),
    ({"b_s_per_token_sq": -1e-9}, "b_s_per_token_sq must be a finite number >= 0, got -1e-09"),
    ({"c0_s_per_micro_batch": "0.5"}, "c0_s_per_micro_batch must be a finite number >= 0, got '0.5'"),
    ({"head_s_per_logit_position": True}, "head_s_per_logit_position must be a finite number >= 0, got True"),
    ({"ranks": 0}, "ranks must be a positive integer, got 0"),
    ({"ranks": 2.0}, "ranks must be a positive integer, got 2.0"),
    ({"device": "tpu"}, r"device must be one of \['cpu', 'gpu'\], got 'tpu'"),
    ({"ranks_meet": "step"}, r"ranks_meet must be one of \['micro_step', 'optimizer_step'\], got 'step'"),
])
def test_a_bad_file_is_refused_naming_the_key(tmp_path, changes, message):
    with pytest.raises(ValueError, match=r"step model .*model\.json: " + message):
        load(_file(tmp_path, **changes))


def test_not_a_number_unreadable_and_other_ranks_are_refused(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(GOOD).replace("0.001", "NaN"))
    with pytest.raises(ValueError, match="a_s_per_token must be a finite number >= 0, got nan"):
        load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load(path)
    with pytest.raises(ValueError, match="absent.json"):
        load(tmp_path / "absent.json")
    with pytest.raises(ValueError, match="was measured with 2 ranks; pricing 4 ranks with it would price another "
                                         "machine"):
        measured_step_model(_file(tmp_path), world=4)


def _rows(tokens, labels):
    zeros = np.zeros(len(tokens), dtype=np.int64)
    return SimpleNamespace(tokens=np.asarray(tokens, dtype=np.int64), label_tokens=np.asarray(labels, dtype=np.int64),
                           images=zeros, patches=zeros, patch_sq=zeros)


def test_ranks_meet_at_the_optimizer_step_or_at_every_micro_step(tmp_path):
    """Two ranks, one optimizer step of two micro-steps: rank 0 runs 100 then 10 tokens, rank 1
    10 then 100. Meeting at every micro-step costs max(100, 10) twice; meeting at the optimizer
    step, the larger of the two ranks' sums (110 each)."""
    rows = _rows([100, 10, 10, 100], [0, 0, 0, 0])
    steps = [[np.array([0]), np.array([1])], [np.array([2]), np.array([3])]]
    f = features(Schedule("standard", 2, steps, accumulation=2, cost_mode="packed"), rows)
    per_token = replace(measured_step_model(_file(tmp_path), 2), c0=0.0, idle_s=0.0, b=0.0, head=0.0, a=1.0)
    assert evaluate(f, rows, per_token).time_s == 110.0
    assert evaluate(f, rows, replace(per_token, ranks_meet="micro_step")).time_s == 200.0


def test_logits_are_priced_where_the_run_computes_them(tmp_path):
    """Standard computes logits at every occupied position (padding included); ODB with
    `odb_supervised_logits` at the supervised ones only."""
    rows = _rows([30, 20, 50], [5, 20, 1])
    steps = [[np.array([0, 1]), np.array([2])]]
    head_only = replace(measured_step_model(_file(tmp_path), 2), c0=0.0, idle_s=0.0, a=0.0, b=0.0, head=1.0)
    padded = features(Schedule("standard", 2, steps, cost_mode="padded"), rows)
    assert padded.logit_positions().tolist() == [[60, 50]]
    assert evaluate(padded, rows, head_only).time_s == 60.0
    kept = features(Schedule("odb", 2, steps, cost_mode="packed"), rows, supervised_logits=True)
    assert kept.logit_positions().tolist() == [[25, 1]]
    assert evaluate(kept, rows, head_only).time_s == 25.0


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 4), accumulation=st.integers(1, 4), data=st.data())
def test_meeting_less_often_never_costs_more(tmp_path_factory, world, accumulation, data):
    """Waiting for the slowest rank once per optimizer step costs at most what waiting at every
    micro-step costs, and the same with one rank."""
    micro = data.draw(st.integers(1, 3)) * accumulation
    tokens = data.draw(st.lists(st.integers(1, 500), min_size=micro * world, max_size=micro * world))
    rows = _rows(tokens, [t // 2 for t in tokens])
    ids = iter(range(len(tokens)))
    steps = [[np.array([next(ids)]) for _ in range(world)] for _ in range(micro)]
    f = features(Schedule("standard", world, steps, accumulation=accumulation, cost_mode="padded"), rows)
    path = tmp_path_factory.mktemp("model") / "model.json"
    path.write_text(json.dumps(dict(GOOD, ranks=world)))
    at_step = evaluate(f, rows, measured_step_model(path, world)).time_s
    at_micro = evaluate(f, rows, replace(measured_step_model(path, world), ranks_meet="micro_step")).time_s
    assert at_step <= at_micro * (1 + 1e-12)
    if world == 1:
        assert math.isclose(at_step, at_micro, rel_tol=1e-12)


def test_the_dry_run_plans_a_cpu_run_with_a_measured_model(text_model, tmp_path):
    """With a model whose only cost is a micro-batch's fixed time, the predicted speedup is
    Standard's micro-batches over ODB's, read from the plan's own figures; the budget is the
    one a CPU run decides; a recipe with images is refused."""
    from odb_factory.dry_run.__main__ import make_plan, parser
    if not lf_runs.SHARED_DEMO.exists():
        pytest.skip("shared LLaMA-Factory demo data is absent")
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps(
        {"alpaca": {"file_name": str(lf_runs.SHARED_DEMO / "alpaca_en_demo.json")}}))
    config = lf_runs.base_yaml(text_model, data, tmp_path / "out", dataset="alpaca", template="qwen3_nothink",
                               cutoff_len=256, max_samples=64, per_device_train_batch_size=1,
                               gradient_accumulation_steps=4, odb_enable=True)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(config))
    fixed_only = _file(tmp_path, a_s_per_token=0.0, b_s_per_token_sq=0.0, head_s_per_logit_position=0.0)
    plan = make_plan(parser().parse_intermixed_args([str(recipe), "--world-size", "2", "--workers", "0",
                                                     "--no-progress", "--step-model", str(fixed_only)]))
    assert plan["settings"]["odb_token_budget"] == 1024 and "CPU" in plan["settings"]["odb_token_budget_reason"]
    assert plan["speedup"]["step_model"]["hardware"] == "measured (cpu, 2 ranks)"
    assert plan["speedup"]["supervised_logits"] == {"samples": True, "groups": True}
    figures = plan["plan"]
    assert plan["speedup"]["samples"]["speedup"] == pytest.approx(
        figures["standard"]["micro_batches"] / figures["samples"]["micro_batches"], rel=1e-12)
    assert figures["samples"]["micro_batches"] < figures["standard"]["micro_batches"]
    assert plan["speedup"]["samples"]["low"] is None and plan["speedup"]["band"].startswith("none")
    h20 = make_plan(parser().parse_intermixed_args([str(recipe), "--world-size", "2", "--workers", "0",
                                                    "--no-progress"]))
    assert h20["settings"]["odb_token_budget"] != 1024 and "measured_from" not in h20["speedup"]["step_model"]


def test_a_measured_model_refuses_rows_with_images(tiny_model, demo_data, tmp_path):
    from odb_factory.dry_run.__main__ import make_plan, parser
    config = lf_runs.base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="prices text rows only .* the recipe's rows hold images"):
        make_plan(parser().parse_intermixed_args([str(recipe), "--world-size", "2", "--workers", "0",
                                                  "--no-progress", "--step-model", str(_file(tmp_path))]))
