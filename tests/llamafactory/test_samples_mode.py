"""End to end, `odb_step: samples` (the default): the same YAML with `odb_enable: true` trains
the fixed-batch run's model — the same optimizer steps, the same logged losses, the same
final eval loss — under DDP and ZeRO-2, on image and text-only data (2 CPU ranks, fp32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.lf_runs import balance_stages, base_yaml, ledger, log_history, train

pytest.importorskip("llamafactory")

REL = 1e-3


def _text_only(demo_data: Path, out: Path) -> Path:
    rows = [r for r in json.loads((demo_data / "demo.json").read_text()) if not r.get("images")]
    out.mkdir()
    (out / "demo.json").write_text(json.dumps(rows))
    shutil.copy(demo_data / "dataset_info.json", out / "dataset_info.json")
    return out


_STANDARD_RUNS: dict = {}  # one Standard run per distinct YAML, shared by the tests that compare with it


def _standard(tmp_path, model, data, name, common) -> Path:
    key = (str(model), str(data), json.dumps(common, sort_keys=True))
    if key not in _STANDARD_RUNS:
        out = tmp_path / f"{name}_standard"
        train(base_yaml(model, data, out, **common), nproc=2)
        _STANDARD_RUNS[key] = out
    return _STANDARD_RUNS[key]


def _pair(tmp_path, model, data, name, odb_extra=None, **extra):
    """(Standard history, ODB history, ODB ledger) for the same YAML, ODB on or off
    (`odb_extra`: further odb_* keys of the ODB run)."""
    common = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, val_size=0.2,
                  per_device_eval_batch_size=4, eval_strategy="no", do_eval=True, learning_rate=2e-3,
                  lr_scheduler_type="cosine", warmup_ratio=0.1, max_grad_norm=1.0, seed=11, **extra)
    std = _standard(tmp_path, model, data, name, common)
    odb = tmp_path / f"{name}_odb"
    audit = tmp_path / f"{name}_audit"
    train(base_yaml(model, data, odb, odb_enable=True, odb_token_budget=512, odb_collate_workers=1,
                    odb_audit_dir=str(audit), **(odb_extra or {}), **common), nproc=2)
    return _history(std), _history(odb), ledger(audit)


def _history(out: Path):
    """The training log lines, then the final evaluation (written after trainer_state.json)."""
    return log_history(out) + [json.loads((out / "eval_results.json").read_text())]


def _assert_same_training(standard, odb, rows):
    std_steps = [h for h in standard if "loss" in h]
    odb_steps = [h for h in odb if "loss" in h]
    assert [h["step"] for h in odb_steps] == [h["step"] for h in std_steps], "other optimizer steps"
    for a, b in zip(std_steps, odb_steps):
        assert b["loss"] == pytest.approx(a["loss"], rel=REL), f"step {a['step']}: {a['loss']} vs {b['loss']}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=10 * REL), f"step {a['step']} grad_norm"
        assert b["learning_rate"] == pytest.approx(a["learning_rate"], rel=1e-9)
    std_eval = [h["eval_loss"] for h in standard if "eval_loss" in h]
    odb_eval = [h["eval_loss"] for h in odb if "eval_loss" in h]
    assert std_eval and odb_eval[-1] == pytest.approx(std_eval[-1], rel=REL)
    # ODB packed steps into fewer micro-batches than the fixed-batch run's 4
    assert any(r["micro_steps"] < 4 for r in rows), "nothing was packed"
    assert all(len({r["micro_steps"] for r in rows if r["step"] == s}) == 1 for s in {r["step"] for r in rows})


def test_samples_mode_trains_the_standard_model_ddp_images(tmp_path, tiny_model, demo_data):
    """Images under DDP, with both balancing stages on: samples move between ranks for the
    LLM stage, images for the vision encoder, and the model is still Standard's."""
    standard, odb, rows = _pair(tmp_path, tiny_model, demo_data, "ddp", freeze_vision_tower=False,
                                odb_extra={"odb_balance": True, "odb_balance_stages": balance_stages()})
    _assert_same_training(standard, odb, rows)
    assert any("odb/balance_max_over_lb" in h for h in odb), "post-balancing ran"


def test_samples_mode_trains_the_standard_model_zero2_text(tmp_path, tiny_model, demo_data):
    data = _text_only(demo_data, tmp_path / "text_only")
    ds_config = Path(__file__).resolve().parents[2] / "recipes" / "parts" / "deepspeed" / "ds_z2.json"
    standard, odb, rows = _pair(tmp_path, tiny_model, data, "zero2", deepspeed=str(ds_config))
    _assert_same_training(standard, odb, rows)
    assert any("odb/balance_max_over_lb" in h for h in odb), "post-balancing ran (odb_balance: auto)"


def test_samples_mode_trains_the_standard_model_text_model_post_balanced(tmp_path, demo_data):
    """A text-only model: LLaMA-Factory lets transformers normalise its loss by the step's
    global token count (`model_accepts_loss_kwargs`), the other Standard loss; with
    post-balancing on, samples move between ranks with their weights."""
    from odb_factory.demo.tiny_qwen3 import build_tiny_qwen3
    model = build_tiny_qwen3(tmp_path / "tiny_qwen3", seed=0)
    data = _text_only(demo_data, tmp_path / "text_only")
    standard, odb, rows = _pair(tmp_path, model, data, "text_model", template="qwen3_nothink",
                                odb_extra={"odb_balance": True})
    _assert_same_training(standard, odb, rows)
    assert any("odb/balance_max_over_lb" in h for h in odb), "post-balancing ran"


def test_padding_free_global_grouping_samples_mode_trains_the_standard_model(tmp_path, tiny_model, demo_data):
    """`odb_padding_free: true` with `odb_global_grouping: true` and post-balancing: each
    optimizer step's micro-batches are formed over both ranks' samples, each one or two
    flattened rows without padding (rows of at most 384 of the budget's 512 tokens), the loss
    weights per token, and the model is still Standard's (images, trainable vision tower, DDP)."""
    standard, odb, rows = _pair(tmp_path, tiny_model, demo_data, "padding_free", freeze_vision_tower=False,
                                odb_extra={"odb_padding_free": True, "odb_global_grouping": True,
                                           "odb_balance": True, "odb_padding_free_row_tokens": 384})
    _assert_same_training(standard, odb, rows)
    assert any("odb/balance_max_over_lb" in h for h in odb), "post-balancing ran"
    assert any(h.get("odb/global_grouping_rounds", 0) > 0 for h in odb), "global grouping re-laid out steps"
    assert all(r["padded_tokens"] == r["input_tokens"] for r in rows), "a padding-free group costs its tokens"


def test_samples_mode_resumes_its_post_balanced_steps_as_a_continuation(tmp_path, tiny_model, demo_data):
    """The default keys on 2 ranks post-balance every step (`odb_balance: auto`); a run resumed
    from a checkpoint trains the uninterrupted run's steps: each (step, rank)'s samples, every
    logged loss, learning rate and gradient norm, and the final checkpoint."""
    data = _text_only(demo_data, tmp_path / "text_only")
    common = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, learning_rate=2e-3,
                  warmup_ratio=0.1, max_grad_norm=1.0, seed=11, eval_strategy="no", save_strategy="steps",
                  save_steps=2, odb_enable=True, odb_token_budget=512)
    out, audit = tmp_path / "uninterrupted", tmp_path / "uninterrupted_audit"
    proc = train(base_yaml(tiny_model, data, out, odb_audit_dir=str(audit), **common), nproc=2)
    assert "ODB: post-balancing on (odb_balance: auto, odb_step: samples on 2 ranks" in proc.stdout + proc.stderr
    rows = ledger(audit)
    last = max(r["step"] for r in rows)
    assert last >= 4, "too few steps to resume in the middle"
    assert any("odb/balance_max_over_lb" in h for h in log_history(out)), "post-balancing ran"
    resumed, resumed_audit = tmp_path / "resumed", tmp_path / "resumed_audit"
    train(base_yaml(tiny_model, data, resumed, odb_audit_dir=str(resumed_audit),
                    resume_from_checkpoint=str(out / "checkpoint-2"), **common), nproc=2)

    def steps(ledger_rows):
        return sorted((r["step"], r["rank"], sorted(r["indices"])) for r in ledger_rows if r["step"] > 2)
    assert steps(ledger(resumed_audit)) == steps(rows), "the resumed run trained other samples"

    def logged(out_dir):
        return {h["step"]: h for h in log_history(out_dir) if "loss" in h and h["step"] > 2}
    uninterrupted, continued = logged(out), logged(resumed)
    assert sorted(continued) == sorted(uninterrupted) and continued
    for number, entry in continued.items():
        for key in ("loss", "learning_rate", "grad_norm"):
            assert entry[key] == pytest.approx(uninterrupted[number][key], rel=1e-6, abs=1e-12), (number, key)
    assert (resumed / f"checkpoint-{last}" / "odb_state_rank0.json").exists()
