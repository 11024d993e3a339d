"""Stage pt (continued pre-training) with ODB through the stock CLI, 2 CPU ranks: each document
is a sample of its own length (an unset `packing` becomes false), and `odb_step: samples` trains
the fixed-batch run's model: the same optimizer steps, losses and eval loss."""

from __future__ import annotations


import pytest

from tests.helpers.lf_runs import assert_trains_the_standard_model, base_yaml, ledger, train

pytest.importorskip("llamafactory")

REL = 1e-5


def _yaml(model, data, out, **extra):
    return base_yaml(model, data, out, stage="pt", dataset="docs", template="qwen3_nothink", cutoff_len=256,
                     max_samples=96, per_device_train_batch_size=1, gradient_accumulation_steps=4, val_size=0.1,
                     per_device_eval_batch_size=4, eval_strategy="no", do_eval=True, learning_rate=2e-3,
                     warmup_ratio=0.1, max_grad_norm=1.0, seed=3, **extra)


@pytest.mark.slow
def test_pt_samples_mode_trains_the_standard_model(tmp_path, text_model, pt_data):
    std, odb, audit = tmp_path / "standard", tmp_path / "odb", tmp_path / "audit"
    train(_yaml(text_model, pt_data, std, packing=False), nproc=2)
    # the default budget (auto) on CPU
    proc = train(_yaml(text_model, pt_data, odb, odb_enable=True, odb_audit_dir=str(audit)), nproc=2)
    assert "ODB: odb_token_budget 1024 (odb_token_budget: auto, odb_step: samples on CPU" in proc.stdout + proc.stderr
    assert "ODB: post-balancing on (odb_balance: auto" in proc.stdout + proc.stderr
    assert_trains_the_standard_model(std, odb, REL)
    rows = ledger(audit)
    assert any(r["micro_steps"] < 4 for r in rows), "nothing was packed"


def test_pt_refuses_packing_and_other_stages_keep_their_refusal(tmp_path, text_model, pt_data):
    import odb_factory_patches
    from llamafactory.hparams import get_train_args
    odb_factory_patches.apply()
    with pytest.raises(ValueError, match="packing/neat_packing: ODB forms token-budgeted groups itself"):
        get_train_args(_yaml(text_model, pt_data, tmp_path / "o", packing=True, odb_enable=True))
    parsed = get_train_args(_yaml(text_model, pt_data, tmp_path / "o", odb_enable=True))
    assert parsed[1].packing is False   # documents stay whole: ODB batches them by length
    assert get_train_args(_yaml(text_model, pt_data, tmp_path / "o"))[1].packing is True  # upstream's default
    rm = base_yaml(text_model, pt_data, tmp_path / "o", stage="rm", dataset="docs", template="qwen3_nothink")
    with pytest.raises(ValueError, match=r"odb_enable: true applies to stage \['sft', 'pt', 'dpo'\]; this run has stage 'rm'"):
        get_train_args(dict(rm, odb_enable=True))
    from odb_factory.llamafactory.run import run_of
    assert run_of(get_train_args(dict(rm, odb_enable=False))[1]) is None  # accepted: upstream runs it
    assert run_of(get_train_args(_yaml(text_model, pt_data, tmp_path / "o", odb_enable=False))[1]) is None
