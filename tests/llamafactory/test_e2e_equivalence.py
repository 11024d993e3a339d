"""End-to-end equivalence: ODB runs of stock LLaMA-Factory on the tiny Qwen3-VL give the
loss a Standard run gives on the same samples, and post-balancing changes where samples train,
never which samples or the loss. Both start from a briefly trained model (trained_start)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.lf_runs import balance_stages, base_yaml, log_history, odb_run, train, trained_indices

pytest.importorskip("llamafactory")


@pytest.fixture(scope="module")
def trained_start(tmp_path_factory, tiny_model, demo_data):
    """A briefly trained model: per-token losses then differ widely, so a loss weighted by
    micro-batch instead of by token would visibly differ from the exact one."""
    out = tmp_path_factory.mktemp("pretrained") / "start"
    train(base_yaml(tiny_model, demo_data, out, max_steps=40, learning_rate=5e-3,
                    per_device_train_batch_size=4, save_strategy="no"))
    return out


FASTEST = {"odb_padding_free": True, "odb_global_grouping": True}  # both, on top of ODB


@pytest.mark.parametrize("extra", [{}, FASTEST])
def test_loss_equals_standard_token_mean_on_the_same_samples(tmp_path, trained_start, demo_data, extra):
    # ODB: 2 ranks x 2 micro-steps (padding-free rows, regrouped over both ranks: the same); the
    # logged loss of optimizer step 1 ...
    out, rows = odb_run(tmp_path, trained_start, demo_data, "odb_loss", nproc=2,
                        gradient_accumulation_steps=2, max_steps=1, learning_rate=1e-9,
                        odb_token_budget=256, **extra)
    first = [r for r in rows if r["step"] == 1]
    samples = trained_indices(first)
    if extra:
        assert any(h.get("odb/global_grouping_rounds", 0) > 0 for h in log_history(out)), "nothing regrouped"
    assert len(first) == 2 and len(samples) > 4
    odb_loss = [h for h in log_history(out) if "loss" in h][0]["loss"]
    # ... equals a Standard run's loss on exactly those samples in one batch (its per-token mean).
    rows_json = json.loads((demo_data / "demo.json").read_text())
    subset_dir = tmp_path / "subset"
    subset_dir.mkdir()
    (subset_dir / "demo.json").write_text(json.dumps([rows_json[i] for i in samples]))
    info = json.loads((demo_data / "dataset_info.json").read_text())
    (subset_dir / "dataset_info.json").write_text(json.dumps(info))
    std = tmp_path / "standard_loss"
    train(base_yaml(trained_start, subset_dir, std, media_dir=str(demo_data), max_steps=1,
                    per_device_train_batch_size=len(samples), disable_shuffling=True, learning_rate=1e-9))
    standard_loss = [h for h in log_history(std) if "loss" in h][0]["loss"]
    assert odb_loss == pytest.approx(standard_loss, abs=2e-4), (odb_loss, standard_loss)


@pytest.mark.parametrize("deepspeed,stages", [(False, balance_stages()), (True, ["llm"])])
def test_balancing_keeps_coverage_and_loss(tmp_path, trained_start, demo_data, deepspeed, stages):
    """Post-balancing only moves samples (LLM stage) and images (vision stage) between
    ranks within a step: the same samples per optimizer step, the same loss curve, every
    index once."""
    extra = {"gradient_accumulation_steps": 2, "max_steps": 4, "learning_rate": 1e-3,
             "odb_token_budget": 384, "freeze_vision_tower": False}
    if "vision" in stages:  # vision-stage balancing trains padded groups: the run without it too
        extra["odb_padding_free"] = False
    if deepspeed:
        ds_config = tmp_path / "ds_z2.json"
        ds_config.write_text(json.dumps({
            "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 2}}))
        extra["deepspeed"] = str(ds_config)
    off, rows_off = odb_run(tmp_path, trained_start, demo_data, "balance_off", nproc=2, **extra)
    on, rows_on = odb_run(tmp_path, trained_start, demo_data, "balance_on", nproc=2, odb_balance=True,
                          odb_balance_stages=stages, **extra)
    for step in range(1, 5):
        assert (trained_indices([r for r in rows_on if r["step"] == step])
                == trained_indices([r for r in rows_off if r["step"] == step]))
    loss_off = [h["loss"] for h in log_history(off) if "loss" in h]
    loss_on = [h["loss"] for h in log_history(on) if "loss" in h]
    assert loss_on == pytest.approx(loss_off, abs=2e-4)
    history = [h for h in log_history(on) if "odb/balance_max_over_lb" in h]
    assert history, "balance metrics reach the trainer logs"
    assert all(h["odb/balance_max_over_lb"] <= h["odb/balance_max_over_lb_before"] + 1e-9 for h in history)
