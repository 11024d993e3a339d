"""ODBCallback: the epoch and step bound it keeps for HF's loop, the per-rank state it writes into
checkpoints and restores, the audit ledger and the logged metrics; driven with transformers'
own TrainerState/TrainerControl over a real TrainLoader (one process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import TrainerControl, TrainerState

from odb_factory import ODBConfig, ODBDataLoader
from odb_factory.llamafactory.audit_ledger import read_rank_ledgers
from odb_factory.llamafactory.callbacks import ODBCallback, state_path
from odb_factory.llamafactory.run import SampleProgress
from odb_factory.llamafactory.step_modes import GroupsMode
from odb_factory.llamafactory.train_loader import TrainLoader
from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate

SAMPLES = 29
ACCUMULATION = 2


def _world(tmp_path, epochs=1.0, audit="audit", samples=SAMPLES):
    dataset = LengthDataset(long_tail_lengths(samples, cv=1.0, mean=30, seed=2, maximum=160))
    cfg = ODBConfig(token_budget=192, buffer_size=6, gradient_accumulation_steps=ACCUMULATION, seed=3,
                    pad_epoch_to_accumulation=True, step_mode="groups", loss_scaling="exact")
    control = TrainerControl()
    progress = SampleProgress()
    progress.start(int(samples * epochs))
    loader = TrainLoader(ODBDataLoader(dataset, cfg, collate_fn=pad_collate), GroupsMode(), progress,
                         lambda: control, samples, steps_per_epoch=0)
    callback = ODBCallback(lambda: loader, progress, rank=0, audit_dir=str(tmp_path / audit) if audit else None,
                           row_of=lambda i: 1000 + i, max_steps_from_user=False, num_train_epochs=epochs)
    return loader, callback, control


def _train(loader, callback, control, trainer_state, args, stop_after=None, save_at=None, after_step=None,
           before_step_end=None):
    """HF's loop, as far as the callback sees it: an optimizer step every ACCUMULATION micro-steps
    (its save/evaluate flags cleared first, as HF clears them once acted on; then
    `before_step_end()`, as the callbacks ahead of ODB's), `after_step()` after each, and a
    checkpoint at step `save_at`."""
    callback.on_train_begin(args, trainer_state, control)
    micro = 0
    for _ in loader:
        micro += 1
        if micro % ACCUMULATION:
            continue
        trainer_state.global_step += 1
        control.should_save = control.should_evaluate = False
        if before_step_end is not None:
            before_step_end()
        callback.on_step_end(args, trainer_state, control)
        if after_step is not None:
            after_step()
        if trainer_state.global_step == save_at:
            (Path(args.output_dir) / f"checkpoint-{save_at}").mkdir(parents=True)
            callback.on_save(args, trainer_state, control)
        if control.should_training_stop or trainer_state.global_step == stop_after:
            break
    return trainer_state


def _args(tmp_path):
    from types import SimpleNamespace
    return SimpleNamespace(output_dir=str(tmp_path / "out"))


def test_the_epoch_follows_the_samples_and_the_step_bound_stays_ahead(tmp_path):
    loader, callback, control = _world(tmp_path)
    state = TrainerState(max_steps=3, eval_steps=1000)  # HF's estimate, below the real count
    from types import SimpleNamespace
    args = SimpleNamespace(eval_strategy="steps", save_strategy="steps", eval_delay=0)
    try:
        loader.set_epoch(0)
        epochs, bounds = [], []
        _train(loader, callback, control, state, args,
               after_step=lambda: (epochs.append(state.epoch), bounds.append(state.max_steps)))
        assert epochs == sorted(epochs) and epochs[-1] == pytest.approx(1.0)
        assert all(bound >= step + 1 for step, bound in enumerate(bounds, 1) if epochs[step - 1] < 1.0)
        assert control.should_training_stop, "the data ran out: training must stop"
        # the last step is known only now: saved and evaluated as HF does at its last step
        assert state.max_steps == state.global_step and control.should_save and control.should_evaluate
        callback.on_train_end(None, state, control)
        assert state.max_steps == state.global_step
        ledger, = read_rank_ledgers(str(tmp_path / "audit"))
        assert [line["step"] for line in ledger] == list(range(1, state.global_step + 1))
        rows = sorted(i for line in ledger for i in line["indices"])
        assert rows == [1000 + i for i in range(SAMPLES)]  # the dataset rows, each once
    finally:
        loader.loader.close()


def test_the_progress_bar_follows_the_estimate_and_ends_at_the_real_count(tmp_path):
    """HF's bar takes its total from the first estimate (here 3, below the real count)."""
    import io
    from types import SimpleNamespace

    from tqdm import tqdm
    loader, callback, control = _world(tmp_path, audit=False)
    bar = tqdm(total=3, file=io.StringIO())
    callback.progress_bar_of = lambda: bar
    state = TrainerState(max_steps=3, eval_steps=1000)
    totals = []

    def after_step():
        bar.update(state.global_step - bar.n)  # as HF's ProgressCallback does, before ODB's callback
        totals.append((bar.total, state.max_steps))
    try:
        loader.set_epoch(0)
        _train(loader, callback, control, state, SimpleNamespace(eval_strategy="no", save_strategy="no"),
               after_step=after_step)
        assert state.global_step > 3 and all(total == bound for total, bound in totals)
        assert bar.n == bar.total == state.global_step
    finally:
        bar.close()
        loader.loader.close()


def test_the_logged_metrics_sum_the_window_then_start_again(tmp_path):
    loader, callback, control = _world(tmp_path, audit=False)
    try:
        loader.set_epoch(0)
        state = _train(loader, callback, control, TrainerState(max_steps=100), None, stop_after=2)
        logged = callback.pop_log_metrics()
        assert logged["odb/micro_steps_per_optimizer_step"] == ACCUMULATION
        assert logged["odb/samples_per_optimizer_step"] == pytest.approx(loader.epoch_consumed / state.global_step)
        assert 0 < logged["odb/padding_efficiency"] <= 1
        assert callback.pop_log_metrics() == {}  # nothing new since the last log line
    finally:
        loader.loader.close()


def test_a_checkpoint_keeps_each_ranks_position_and_a_resume_continues_it(tmp_path):
    """Save at step 3, let the run go on (and die later): the resume into the same audit dir
    trains the rest of the epoch once, and the ledger holds each step and each sample once."""
    args = _args(tmp_path)
    loader, callback, control = _world(tmp_path)
    try:
        loader.set_epoch(0)
        # saved at step 3; steps 4-5 are lost with the run
        _train(loader, callback, control, TrainerState(max_steps=100), args, stop_after=5, save_at=3)
        checkpoint = tmp_path / "out" / "checkpoint-3"
        saved = json.loads(state_path(str(checkpoint), 0).read_text())
        assert saved["progress"][1] == SAMPLES and 0 < saved["progress"][0] < callback.progress.consumed
    finally:
        loader.loader.close()
    (before,) = read_rank_ledgers(str(tmp_path / "audit"))
    assert [line["step"] for line in before] == [1, 2, 3, 4, 5]
    loader, callback, control = _world(tmp_path)
    try:
        callback.resume_from = str(checkpoint)
        loader.set_epoch(0)
        _train(loader, callback, control, TrainerState(global_step=3, max_steps=100), args)
        assert callback.progress.consumed == SAMPLES
    finally:
        loader.loader.close()
    (lines,) = read_rank_ledgers(str(tmp_path / "audit"))
    steps = [line["step"] for line in lines]
    assert steps == list(range(1, len(lines) + 1)) and lines[:3] == before[:3]
    trained = sorted(i for line in lines for i in line["indices"])
    assert trained == [1000 + i for i in range(SAMPLES)]  # nothing twice, nothing lost


def test_a_checkpoint_without_this_ranks_state_is_refused_by_name(tmp_path):
    loader, callback, control = _world(tmp_path, audit=False)
    try:
        callback.resume_from = str(tmp_path / "checkpoint-7")
        with pytest.raises(FileNotFoundError, match=r"odb_state_rank0\.json is missing: this checkpoint was not "
                                                    r"written by an ODB run with the same world size, so ODB cannot "
                                                    r"resume its data position$"):
            callback.on_train_begin(None, TrainerState(global_step=7), control)
    finally:
        loader.loader.close()


def test_the_step_bound_is_the_samples_estimate_at_least_two_steps_ahead(tmp_path):
    """Each step: HF's bound is global_step / fraction of the run's samples consumed, rounded, and
    never within two steps of the count; the epoch is the fraction of this epoch's samples."""
    loader, callback, control = _world(tmp_path, audit=False, samples=120)
    state = TrainerState(max_steps=3, eval_steps=1000)
    seen = []

    def after_step():
        seen.append((state.global_step, callback.progress.fraction, state.max_steps, state.epoch,
                     loader.epoch_consumed, control.should_training_stop))
    try:
        loader.set_epoch(0)
        _train(loader, callback, control, state, None, after_step=after_step)
    finally:
        loader.loader.close()
    *running, last = seen
    # both regimes: the estimate ahead early on, the two-step floor near the end
    assert any(round(step / fraction) > step + 2 for step, fraction, *_ in running)
    assert any(round(step / fraction) < step + 2 for step, fraction, *_ in running)
    for step, fraction, bound, epoch, consumed, stop in running:
        assert bound == max(round(step / fraction), step + 2), (step, fraction)
        assert epoch == consumed / 120 and not stop
    step, fraction, bound, epoch, consumed, stop = last
    assert fraction == 1.0 and bound == step and epoch == 1.0 and stop


def test_a_stop_at_hfs_estimate_is_undone_and_any_other_stop_kept(tmp_path):
    """HF's flow callback stops the loop when global_step reaches its step bound (an estimate
    ODB's variable steps overrun): undone. A stop another callback asks for before that: kept."""
    loader, callback, control = _world(tmp_path, audit=False)
    state = TrainerState(max_steps=100)
    seen = []

    def stop():
        if state.global_step == 1:
            state.max_steps = 1   # HF's flow callback: global_step >= max_steps
        control.should_training_stop = True   # step 2: a user's callback, below the bound

    try:
        loader.set_epoch(0)
        _train(loader, callback, control, state, None, before_step_end=stop,
               after_step=lambda: seen.append((control.should_training_stop, state.max_steps)))
    finally:
        loader.loader.close()
    (undone, bound), (kept, _) = seen
    assert not undone and bound >= 3 and kept


@pytest.mark.parametrize("from_user", [True, False])
def test_the_bound_is_the_users_max_steps_when_given(tmp_path, from_user):
    loader, callback, control = _world(tmp_path, audit=False)
    callback.max_steps_from_user = from_user
    try:
        loader.set_epoch(0)
        state = _train(loader, callback, control, TrainerState(max_steps=50), None, stop_after=2)
        assert state.max_steps == (50 if from_user else max(round(2 / callback.progress.fraction), 4))
        callback.on_train_end(None, state, control)
        assert state.max_steps == (50 if from_user else 2)
    finally:
        loader.loader.close()


def test_a_new_run_into_an_audit_dir_starts_its_ledger_again(tmp_path):
    old = tmp_path / "audit" / "rank0.jsonl"
    old.parent.mkdir()
    old.write_text("".join(json.dumps({"step": s, "indices": []}) + "\n" for s in (1, 2, 3)))
    loader, callback, control = _world(tmp_path)
    try:
        loader.set_epoch(0)
        _train(loader, callback, control, TrainerState(max_steps=100), None, stop_after=2)
    finally:
        loader.loader.close()
    (lines,) = read_rank_ledgers(str(tmp_path / "audit"))
    assert [line["step"] for line in lines] == [1, 2] and all(line["indices"] for line in lines)
    assert all(line["epoch"] == 0 for line in lines)
