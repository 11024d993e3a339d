"""End-to-end: stock LLaMA-Factory training (`llamafactory-cli train`, or the launcher command it
runs: tests/helpers/lf_runs.py) on the tiny Qwen3-VL with odb_* keys."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time

import pytest

from tests.helpers import lf_runs
from tests.helpers.lf_runs import (GROUPS_ODB, NUM_SAMPLES, base_yaml, ledger, log_history, odb_run, train,
                                   trained_indices)

pytest.importorskip("llamafactory")


def test_one_process_two_epochs_schedule_coverage_and_eval(tmp_path, tiny_model, demo_data):
    out, rows = odb_run(tmp_path, tiny_model, demo_data, "single", num_train_epochs=2,
                        gradient_accumulation_steps=2, warmup_ratio=0.1, val_size=0.25,
                        eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=4,
                        report_to="tensorboard", save_strategy="steps", save_steps=1)
    train_split = NUM_SAMPLES - NUM_SAMPLES // 4
    for epoch in (0, 1):
        assert trained_indices([r for r in rows if r["epoch"] == epoch]) == list(range(train_split))
    evals = [h for h in log_history(out) if "eval_loss" in h]
    assert len(evals) >= 2 and all(math.isfinite(h["eval_loss"]) for h in evals)
    history = [h for h in log_history(out) if "loss" in h]
    assert [h["step"] for h in history] == list(range(1, len(history) + 1))
    assert history[-1]["epoch"] == pytest.approx(2.0)
    # the LR schedule follows samples: warmup peak, then cosine down to ~0 at the last step
    lrs = [h["learning_rate"] for h in history]
    # (HF logs the LR before the last update, so the last value is the one near 90% progress)
    assert max(lrs) <= 1.0e-3 + 1e-12 and lrs[-1] < 0.1 * 1.0e-3
    assert lrs.index(max(lrs)) < len(lrs) // 4
    assert all(0 < h["odb/padding_efficiency"] <= 1 for h in history)
    assert all(r["micro_steps"] == 2 for r in rows), "every optimizer step is a full accumulation window"
    # the ODB metrics reach TensorBoard when report_to asks for it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = set()
    for run_dir in {p.parent for p in out.rglob("events.out.tfevents.*")}:
        tags |= set(EventAccumulator(str(run_dir)).Reload().Tags()["scalars"])
    assert {"train/odb/padding_efficiency", "train/odb/data_wait_s"} <= tags, sorted(tags)
    _resume_in_the_second_epoch(tmp_path, tiny_model, demo_data, out, rows)


def _resume_in_the_second_epoch(tmp_path, tiny_model, demo_data, out, rows):
    """Resuming mid-way through epoch 2 continues the uninterrupted run: the same steps (each
    sample once), the same logged losses, learning rates and gradient norms, and the final
    checkpoint. HF starts its epoch loop at global_step // (its per-epoch step bound), an
    earlier epoch than the loader's: the loader must not restart that epoch."""
    second = [r for r in rows if r["epoch"] == 1]
    step = second[len(second) // 2 - 1]["step"]
    checkpoint = out / f"checkpoint-{step}"
    saved = json.loads((checkpoint / "odb_state_rank0.json").read_text())
    assert saved["loader"]["epoch"] == 1 and 0 < saved["epoch_consumed"] < NUM_SAMPLES
    audit = tmp_path / "resumed_audit"
    config = base_yaml(tiny_model, demo_data, tmp_path / "resumed", odb_audit_dir=str(audit),
                       resume_from_checkpoint=str(checkpoint), num_train_epochs=2,
                       gradient_accumulation_steps=2, warmup_ratio=0.1, val_size=0.25,
                       save_strategy="steps", save_steps=1000, **GROUPS_ODB)
    train(config)
    resumed = ledger(audit)
    assert resumed and {r["epoch"] for r in resumed} == {1}
    assert resumed[0]["step"] == step + 1
    after = [r for r in rows if r["step"] > step]
    assert [(r["step"], r["indices"]) for r in resumed] == [(r["step"], r["indices"]) for r in after]

    def logged(out_dir):
        return {h["step"]: h for h in log_history(out_dir) if "loss" in h and h["step"] > step}
    uninterrupted, continued = logged(out), logged(tmp_path / "resumed")
    assert sorted(continued) == sorted(uninterrupted)
    for number, entry in continued.items():
        for key in ("loss", "learning_rate", "grad_norm"):
            assert entry[key] == pytest.approx(uninterrupted[number][key], rel=1e-6, abs=1e-12), (number, key)
    last = max(r["step"] for r in rows)
    assert (tmp_path / "resumed" / f"checkpoint-{last}" / "odb_state_rank0.json").exists()


@pytest.mark.parametrize("join", [True, False])
def test_two_ranks_ddp_join_and_nonjoin(tmp_path, tiny_model, demo_data, join):
    _, rows = odb_run(tmp_path, tiny_model, demo_data, f"ddp_join{join}", nproc=2, odb_join=join)
    steps = {rank: [r["step"] for r in rows if r["rank"] == rank] for rank in (0, 1)}
    assert steps[0] == steps[1], "both ranks ran the same optimizer steps"
    indices = trained_indices(rows)
    if join:
        assert indices == list(range(NUM_SAMPLES))
    else:
        assert len(indices) == NUM_SAMPLES
    # vision patches are recorded exactly for the steps that trained images (merge 2x2 units)
    demo_rows = json.loads((demo_data / "demo.json").read_text())
    for r in rows:
        has_image = any(demo_rows[i]["images"] for i in r["indices"])
        assert (r["vision_patches"] > 0) == has_image and r["vision_patches"] % 4 == 0, r
    # the benchmark's measured layer reads these ledgers: per step, the busiest rank's work
    from bench.measured import step_records
    records = step_records(str(tmp_path / f"ddp_join{join}_audit"))
    assert len(records) == len(steps[0]) - 1
    by_step = {s: [r for r in rows if r["step"] == s] for s in steps[0][1:]}
    assert [rec["padded_tokens"] for rec in records] == [max(r["padded_tokens"] for r in by_step[s])
                                                         for s in steps[0][1:]]
    assert all(rec["seconds"] > 0 for rec in records)


def test_two_ranks_zero2(tmp_path, tiny_model, demo_data):
    ds_config = tmp_path / "ds_z2.json"
    ds_config.write_text(json.dumps({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True}}))
    _, rows = odb_run(tmp_path, tiny_model, demo_data, "zero2", nproc=2, deepspeed=str(ds_config),
                      gradient_accumulation_steps=2)
    assert trained_indices(rows) == list(range(NUM_SAMPLES))


def test_without_odb_keys_llamafactory_runs_upstream(tmp_path, tiny_model, demo_data):
    out = tmp_path / "upstream"
    proc = train(base_yaml(tiny_model, demo_data, out, max_steps=3), via_cli=True)
    assert "odb/" not in proc.stdout + proc.stderr
    assert [h["step"] for h in log_history(out) if "loss" in h] == [1, 2, 3]


def test_disable_switch_turns_the_hook_off(tmp_path, tiny_model, demo_data):
    config = base_yaml(tiny_model, demo_data, tmp_path / "disabled", max_steps=1, **GROUPS_ODB)
    proc = train(config, check=False, via_cli=True, ODB_FACTORY_DISABLE="1")
    assert proc.returncode != 0
    assert "Some keys are not used by the HfArgumentParser" in proc.stdout + proc.stderr


def test_kill_and_resume_ledger_equals_uninterrupted(tmp_path, tiny_model, demo_data):
    out = tmp_path / "killed"
    audit_a = tmp_path / "audit_a"
    config = base_yaml(tiny_model, demo_data, out, odb_audit_dir=str(audit_a), save_strategy="steps",
                       save_steps=3, **GROUPS_ODB)
    path = tmp_path / "killed.yaml"
    path.write_text(__import__("yaml").safe_dump(config))
    proc = subprocess.Popen([str(lf_runs.BIN / "llamafactory-cli"), "train", str(path)],
                            env=lf_runs.env(FORCE_TORCHRUN="1", NPROC_PER_NODE="2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoint = out / "checkpoint-3"
    deadline = time.time() + 300
    while not all((checkpoint / f"odb_state_rank{r}.json").exists() for r in (0, 1)):
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.time() < deadline, "no checkpoint-3 within 300 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = ledger(audit_a, max_step=3)
    audit_b = tmp_path / "audit_b"
    resumed = dict(config, odb_audit_dir=str(audit_b), resume_from_checkpoint=str(checkpoint),
                   save_strategy="no")
    train(resumed, nproc=2)
    after = ledger(audit_b)
    assert before and after
    assert trained_indices(before + after) == list(range(NUM_SAMPLES)), "no sample lost or repeated"


@pytest.mark.skipif(not lf_runs.SHARED_DEMO.exists(), reason="shared LLaMA-Factory demo data is absent")
def test_real_llamafactory_demo_data(tmp_path, tiny_model):
    data_dir = tmp_path / "real"
    data_dir.mkdir()
    demo = lf_runs.SHARED_DEMO
    (data_dir / "dataset_info.json").write_text(json.dumps({
        "alpaca_en_demo": {"file_name": str(demo / "alpaca_en_demo.json")},
        "mllm_demo": {"file_name": str(demo / "mllm_demo.json"), "formatting": "sharegpt",
                      "columns": {"messages": "messages", "images": "images"},
                      "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                               "assistant_tag": "assistant"}}}))
    out = tmp_path / "real_out"
    config = base_yaml(tiny_model, data_dir, out, dataset="mllm_demo,alpaca_en_demo", max_samples=60,
                       media_dir=str(demo), odb_audit_dir=str(tmp_path / "real_audit"), **GROUPS_ODB)
    train(config, nproc=2, via_cli=True)
    rows = ledger(tmp_path / "real_audit")
    mllm = len(json.loads((demo / "mllm_demo.json").read_text()))
    assert trained_indices(rows) == list(range(min(60, mllm) + 60))


def test_a_missing_image_stops_two_ranks_before_training(tmp_path, tiny_model, demo_data):
    """The media check runs once per node (local rank 0, first under LLaMA-Factory's
    main_process_first); the other rank waits, and the launcher stops it when the check fails."""
    import shutil
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    rows = json.loads((data / "demo.json").read_text())
    missing = [r for r in rows if r.get("images")][-1]["images"][0]
    (data / missing).unlink()
    config = base_yaml(tiny_model, data, tmp_path / "out", **GROUPS_ODB)
    start = time.time()
    proc = train(config, nproc=2, check=False, timeout=300)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert f"image {missing} does not exist" in output, output[-3000:]
    assert "'loss'" not in output and time.time() - start < 300
