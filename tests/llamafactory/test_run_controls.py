"""What else a LLaMA-Factory run controls or reports, with ODB on: a stop asked for by
another trainer callback (a user's, LLaMA-Board's abort) ends the run in groups mode, where ODB
keeps HF's step bound ahead of its variable-batch step count, and the loader's worker
processes end with the training; `effective_tokens_per_sec` counts the tokens trained without
running the lazy pipeline over the dataset again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("llamafactory")

from tests.helpers.lf_runs import base_yaml, env  # noqa: E402

SCRIPT = """
import gc, multiprocessing, sys, yaml
from transformers import TrainerCallback
from llamafactory.train.tuner import run_exp
gc.disable()   # nothing is collected: only the end of training may stop ODB's workers

class StopAfterTwoSteps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= 2:
            control.should_training_stop = True

run_exp(yaml.safe_load(open(sys.argv[1])), callbacks=[StopAfterTwoSteps()])
print("worker processes left:", len(multiprocessing.active_children()))
"""


@pytest.mark.slow
def test_a_stop_requested_by_another_callback_is_honoured(tmp_path, tiny_model, demo_data):
    out = tmp_path / "out"
    config = base_yaml(tiny_model, demo_data, out, odb_enable=True, odb_step="groups", odb_token_budget=2048,
                       max_samples=64, dataloader_num_workers=0)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env(), cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2, state["global_step"]
    assert state["epoch"] < 1.0   # the epoch was cut short, not completed
    # the loader's sample and collate workers ended with the training (a notebook or sweep that
    # trains again in the same process does not carry them, or wait on them, into the next run)
    assert "worker processes left: 0" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_effective_tokens_per_second_counts_the_trained_tokens_without_a_second_pass(
        tmp_path, tiny_model, demo_data):
    from tests.helpers.lf_runs import ledger, train
    out, audit = tmp_path / "out", tmp_path / "audit"
    config = base_yaml(tiny_model, demo_data, out, odb_enable=True, odb_step="groups",
                       odb_token_budget=2048, max_samples=48, odb_audit_dir=str(audit),
                       include_effective_tokens_per_second=True)
    train(config, nproc=2)
    metrics = json.loads((out / "train_results.json").read_text())
    tokens = sum(row["input_tokens"] for row in ledger(audit))   # both ranks' ledgers
    expected = tokens / metrics["train_runtime"] / 2
    assert metrics["effective_tokens_per_sec"] == pytest.approx(expected, rel=1e-3)


@pytest.mark.slow
def test_tokens_seen_counts_every_micro_batch_of_a_samples_mode_step(tmp_path, tiny_model, demo_data):
    """`include_num_input_tokens_seen` (LLaMA-Board turns it on): each optimizer step of
    `odb_step: samples` reaches HF's loop as one item holding its micro-batches; transformers
    5.x counts through the trainer's hook, 4.57 reads the item's inputs directly."""
    from tests.helpers.lf_runs import ledger, train
    out, audit = tmp_path / "out", tmp_path / "audit"
    config = base_yaml(tiny_model, demo_data, out, odb_enable=True, odb_step="samples", max_samples=48,
                       per_device_train_batch_size=1, gradient_accumulation_steps=4,
                       odb_token_budget=1024, odb_audit_dir=str(audit),
                       include_num_input_tokens_seen="non_padding")
    train(config, nproc=2)
    rows = ledger(audit)   # both ranks' ledgers
    assert rows and all(r["idle_micro_steps"] == 0 for r in rows)
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["num_input_tokens_seen"] == sum(r["input_tokens"] for r in rows) > 0


TWICE = """
import sys, yaml
from llamafactory.train.tuner import run_exp
config = yaml.safe_load(open(sys.argv[1]))
for name in ("first", "second"):   # a sweep or a notebook: two trainings in one process
    run_exp(dict(config, output_dir=f"{sys.argv[2]}/{name}", odb_audit_dir=f"{sys.argv[2]}/{name}_audit"))
"""


@pytest.mark.slow
def test_a_second_training_in_the_same_process_starts_its_own_schedule(tmp_path, tiny_model, demo_data):
    """The sample-driven LR schedule and the token count start afresh with every run: the
    second of two identical runs in one process logs the first's learning rates and counts
    only its own tokens (it used to start at the first run's end: LR 0 from its second step)."""
    from tests.helpers.lf_runs import ledger
    config = base_yaml(tiny_model, demo_data, tmp_path / "first", odb_enable=True, odb_step="groups",
                       odb_token_budget=1024, max_samples=32, dataloader_num_workers=0,
                       include_effective_tokens_per_second=True)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-c", TWICE, str(path), str(tmp_path)], env=env(), cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rates = {}
    for name in ("first", "second"):
        history = json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"]
        rates[name] = [h["learning_rate"] for h in history if "loss" in h]
        metrics = json.loads((tmp_path / name / "train_results.json").read_text())
        tokens = sum(row["input_tokens"] for row in ledger(tmp_path / f"{name}_audit"))
        assert metrics["effective_tokens_per_sec"] * metrics["train_runtime"] == pytest.approx(tokens, rel=1e-3)
    assert len(rates["first"]) > 2 and rates["first"][1] > 0
    assert rates["second"] == pytest.approx(rates["first"], rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["samples", "groups"])
def test_samples_over_the_budget_are_warned_once_and_counted(tmp_path, tiny_model, demo_data, step):
    """A budget below some samples' length: they train alone, each rank warns once, naming the
    YAML keys, and the log counts them (`odb/over_budget_samples`, the logging rank's)."""
    from tests.helpers.lf_runs import log_history, train
    out = tmp_path / "out"
    config = base_yaml(tiny_model, demo_data, out, odb_enable=True, odb_step=step, odb_token_budget=64,
                       max_samples=24, gradient_accumulation_steps=2)
    proc = train(config, nproc=2)
    output = proc.stdout + proc.stderr
    assert output.count("on their own and train alone") == 2, output[-3000:]   # once per rank
    assert "ODBConfig.token_budget (YAML key odb_token_budget)" in output
    counted = sum(row.get("odb/over_budget_samples", 0.0) for row in log_history(out))
    assert counted > 0


@pytest.mark.slow
def test_groups_mode_saves_and_evaluates_at_its_last_step(tmp_path, tiny_model, demo_data):
    """In groups mode the number of optimizer steps is known when the data runs out: that step
    is saved and evaluated as HF's last step is (save/eval by steps), and the logged epoch is 1."""
    from tests.helpers.lf_runs import log_history, train
    out = tmp_path / "out"
    config = base_yaml(tiny_model, demo_data, out, odb_enable=True, odb_step="groups", odb_token_budget=512,
                       max_samples=40, gradient_accumulation_steps=2, save_strategy="steps", save_steps=100,
                       val_size=0.2, eval_strategy="steps", eval_steps=100, per_device_eval_batch_size=2)
    train(config, nproc=2)
    state = json.loads((out / "trainer_state.json").read_text())
    last = state["global_step"]
    assert state["max_steps"] == last < 100
    assert (out / f"checkpoint-{last}").is_dir(), sorted(p.name for p in out.iterdir())
    evals = [row for row in log_history(out) if "eval_loss" in row]
    assert evals and evals[0]["step"] == last
