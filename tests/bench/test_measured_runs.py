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
    assert configs["ODB samples"]["odb_padding_free"] is configs["ODB groups"]["odb_padding_free"] is False
    assert configs["ODB groups"]["odb_step"] == "groups"
    shared = {k for k in std if all(c.get(k) == std[k] for c in configs.values())}
    assert {"learning_rate", "seed", "max_samples", "val_size", "dataset_dir", "model_name_or_path"} <= shared
    assert Path(configs["ODB groups"]["odb_audit_dir"]).name == "ODB groups_audit"
    with pytest.raises(ValueError, match="unknown method"):
        R.method_config("Sorted", base, 6, tmp_path / "x")


def test_step_model_check_recovers_a_known_form_and_scores_each_method():
    # time = 0.1 per micro-batch + 1e-3 per token, exactly: the held-back repeat is predicted exactly
    def row(micro, tokens):
        return {"micro_batches": micro, "tokens": tokens, "sum_sq": 0, "images": 0, "patches": 0, "patch_sq": 0,
                "time_s": 0.1 * micro + 1e-3 * tokens}
    steps = {(m, r): [row(1 + i % 3, 100 * (i + r + 1)) for i in range(6)]
             for m in ("Standard", "ODB samples") for r in range(3)}
    check = {c["method"]: c for c in R.step_model_check(steps, held_back=2)}
    assert set(check) == {"Standard", "ODB samples"}
    assert all(c["steps checked"] == 6 for c in check.values())
    assert all(abs(c["median abs. error per step"]) < 1e-6 and abs(c["step time error (Σ)"]) < 1e-6
               for c in check.values())
    # a method whose held-back steps run 20% slower than the form says is reported so
    steps[("ODB samples", 2)] = [dict(r, time_s=1.2 * r["time_s"]) for r in steps[("ODB samples", 2)]]
    check = {c["method"]: c for c in R.step_model_check(steps, held_back=2)}
    assert check["ODB samples"]["step time error (Σ)"] == pytest.approx(1 / 1.2 - 1, rel=1e-6)
    assert abs(check["Standard"]["step time error (Σ)"]) < 1e-6


def test_packed_rows_count_each_sample_attention_alone():
    import torch

    from bench.lf_multi_run import micro_batch_work, step_work
    padded = {"input_ids": torch.zeros(3, 10, dtype=torch.long), "attention_mask": torch.ones(3, 10)}
    assert micro_batch_work(padded)["sum_sq"] == 300 and micro_batch_work(padded)["tokens"] == 30
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]]).expand(4, 1, 10)   # samples of 3, 2, 5
    packed = {"input_ids": torch.zeros(1, 10, dtype=torch.long), "position_ids": positions,
              "image_grid_thw": torch.tensor([[1, 2, 4], [1, 4, 4]])}
    work = micro_batch_work(packed)
    assert (work["sum_sq"], work["images"], work["patches"], work["patch_sq"]) == (9 + 4 + 25, 2, 24, 64 + 256)

    class Step:
        micro_batches = [padded, packed]
    assert step_work(Step())["micro_batches"] == 2 and step_work(Step())["tokens"] == 40
    # the LM head's positions: all of them, or (where the trainer keeps the supervised logits
    # of that micro-batch) the union of the rows' supervised ones
    labels = torch.full((3, 10), -100)
    labels[0, 4:7], labels[2, 6] = 1, 1                  # next-token positions 3, 4, 5 and 5
    weighted = dict(padded, labels=labels, odb_sample_weights=torch.ones(3))
    assert micro_batch_work(weighted)["logit_tokens"] == 30
    assert micro_batch_work(weighted, supervised_logits=True)["logit_tokens"] == 3 * 3

    unweighted = {k: v for k, v in weighted.items() if k != "odb_sample_weights"}   # computes every position

    class Weighted:
        micro_batches = [weighted, unweighted]
    assert step_work(Weighted(), lambda batch: "odb_sample_weights" in batch)["logit_tokens"] == 9 + 30
    assert step_work(Weighted())["logit_tokens"] == 30 + 30
