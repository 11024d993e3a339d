"""bench.measured_runs' arithmetic and run configurations (the runs themselves are `make bench`'s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import measured_runs as R


def test_interval_is_students_t_on_the_mean():
    mean, half = R.interval([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert half == pytest.approx(4.302652729911275 / 3 ** 0.5)   # t(0.975, 2) · s / √n, s = 1
    assert R.interval([5.0]) == (5.0, None)
    assert R.interval([None, 4.0, 6.0])[0] == 5.0


def _run(method, repeat, sps, loss=1.0, steps=10):
    return {"method": method, "repeat": repeat, "samples_per_s": sps, "tokens_per_s": 100 * sps,
            "eval_loss": loss, "optimizer_steps": steps, "compute_share": 0.5}


def test_ratios_pair_each_repeat_with_its_own_standard():
    runs = [_run("Standard", 0, 10.0), _run("Standard", 1, 20.0),
            _run("ODB samples", 0, 15.0), _run("ODB samples", 1, 20.0)]
    rows = {r["method"]: r for r in R.summary(runs)}
    assert rows["ODB samples"]["_ratio"] == pytest.approx((1.5 + 1.0) / 2)   # not 17.5 / 15
    assert rows["Standard"]["_ratio"] == 1.0
    assert list(rows) == ["Standard", "ODB samples"]


@pytest.mark.parametrize("ratio,half,word", [(1.3, 0.1, "faster than"), (0.7, 0.1, "slower than"),
                                             (1.05, 0.1, "not distinguishable"), (1.2, None, "not distinguishable")])
def test_ratio_wording_follows_the_interval(ratio, half, word):
    assert word in R._ratio_text({"_ratio": ratio, "_ratio_ci": half})


def test_method_configs_differ_only_where_the_method_does(tmp_path):
    base = R.base_config(200)
    configs = {m: R.method_config(m, base, 6, tmp_path / m) for m in R.METHODS}
    std = configs["Standard"]
    assert (std["per_device_train_batch_size"], std["gradient_accumulation_steps"]) == (1, R.ACCUMULATION)
    assert "odb_enable" not in std
    assert configs["Standard at ODB's batch"]["per_device_train_batch_size"] == 6
    assert configs["group_by_length"]["train_sampling_strategy"] == "group_by_length"
    for m in ("ODB samples", "ODB padding-free"):   # the fixed-batch run's steps
        assert configs[m]["odb_step"] == "samples" and configs[m]["gradient_accumulation_steps"] == R.ACCUMULATION
        assert configs[m]["per_device_train_batch_size"] == 1
    assert configs["ODB padding-free"]["odb_padding_free"] is True
    assert configs["ODB groups"]["odb_step"] == "groups"
    shared = {k for k in std if all(c.get(k) == std[k] for c in configs.values())}
    assert {"learning_rate", "seed", "max_samples", "val_size", "dataset_dir", "model_name_or_path"} <= shared
    assert Path(configs["ODB groups"]["odb_audit_dir"]).name == "ODB groups_audit"
    with pytest.raises(ValueError, match="unknown method"):
        R.method_config("Sorted", base, 6, tmp_path / "x")
