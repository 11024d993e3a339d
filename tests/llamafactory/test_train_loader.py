"""TrainLoader: what HF's loop iterates with ODB, in each step mode, over a real ODBDataLoader
(one process; the multi-rank behaviour is the engine's, tested in tests/loader/)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from odb_factory import ODBConfig, ODBDataLoader
from odb_factory.llamafactory.run import SampleProgress
from odb_factory.llamafactory.step_modes import GroupsMode, OptimizerStepBatch, SamplesMode
from odb_factory.llamafactory.train_loader import TrainLoader
from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate

LENGTHS = long_tail_lengths(37, cv=1.0, mean=30, seed=5, maximum=200)


def _train_loader(mode, **config):
    dataset = LengthDataset(LENGTHS)
    cfg = ODBConfig(**{"token_budget": 256, "buffer_size": 8, "gradient_accumulation_steps": 3, "seed": 1,
                       "pad_epoch_to_accumulation": True, "step_mode": mode.name,
                       "loss_scaling": "micro_mean" if mode.name == "samples" else "exact",
                       "standard_batch_size": 2, **config})
    engine = ODBDataLoader(dataset, cfg, collate_fn=pad_collate)
    control = SimpleNamespace(should_epoch_stop=False)
    if mode.name == "samples":
        steps = engine._fixed_batch_steps(0)
        epoch_samples, steps_per_epoch = sum(len(s.indices) for s in steps), len(steps)
    else:
        epoch_samples, steps_per_epoch = len(dataset), 0
    progress = SampleProgress()
    progress.start(epoch_samples)
    return TrainLoader(engine, mode, progress, lambda: control, epoch_samples, steps_per_epoch), control


def test_samples_mode_yields_one_item_per_optimizer_step_with_the_fixed_batch_weights():
    loader, control = _train_loader(SamplesMode())
    try:
        loader.set_epoch(0)
        batches = list(loader)
        assert len(batches) == len(loader) == loader.steps_per_epoch > 0
        assert all(isinstance(b, OptimizerStepBatch) for b in batches)
        steps = loader.take_pending()
        # every sample of the epoch once, and the pending micro-steps are the batches' micro-batches
        trained = sorted(i for s in steps for i in s.indices)
        assert trained == sorted(i for s in loader.loader._fixed_batch_steps(0) for i in s.indices)
        assert sum(len(b.micro_batches) for b in batches) == len(steps)
        for batch in batches:
            weights = torch.cat([m["odb_sample_weights"] for m in batch.micro_batches])
            # micro_mean: each fixed-batch micro-batch's token mean, averaged over its 3 micro-batches
            assert float(sum(w * (m["labels"][r] != -100).sum() for m in batch.micro_batches
                             for r, w in enumerate(m["odb_sample_weights"]))) == pytest.approx(1.0)
            assert weights.dtype == torch.float32
        assert control.should_epoch_stop is True
        assert loader.progress.consumed == loader.epoch_consumed == loader.epoch_samples
        assert loader.progress.fraction == 1.0
        assert loader.progress.input_tokens == sum(s.input_tokens for s in steps)
    finally:
        loader.loader.close()


def test_groups_mode_yields_each_micro_step_and_stops_the_epoch_before_its_bound():
    loader, control = _train_loader(GroupsMode(), token_budget=512)   # an epoch that ends in IDLE steps
    try:
        loader.set_epoch(0)
        assert len(loader) == loader.steps_upper_bound() == 3 * (-(-37 // 3) + 1)
        batches = list(loader)
        assert all(isinstance(b, dict) and "odb_sample_weights" not in b for b in batches)
        steps = loader.take_pending()
        assert len(batches) == len(steps) <= len(loader) and len(steps) % 3 == 0
        assert sorted(i for s in steps for i in s.indices) == list(range(37))
        assert any(step.is_idle for step in steps)
        for step, batch in zip(steps, batches):
            # an IDLE filler trains nothing: groups mode's token-sum loss reads its labels
            assert bool((batch["labels"] == -100).all()) == step.is_idle
        assert control.should_epoch_stop is True and loader.progress.consumed == 37
    finally:
        loader.loader.close()


@pytest.mark.parametrize("mode", [SamplesMode(), GroupsMode()], ids=lambda m: m.name)
def test_a_state_taken_after_an_optimizer_step_resumes_the_rest_of_the_epoch(mode):
    """What a checkpoint keeps (`state_dict`) puts a fresh loader where the first one was: the
    rest of the epoch, nothing trained twice, nothing lost, the progress where it was."""
    first, _ = _train_loader(mode)
    try:
        first.set_epoch(0)
        taken, saved = [], None
        for batch in first:
            taken += first.take_pending()
            if taken[-1].optimizer_step_end if mode.name == "samples" else len(taken) == 6:
                saved = first.state_dict()
                break
    finally:
        first.loader.close()
    assert saved["progress"] == [first.progress.consumed, first.progress.total]
    second, _ = _train_loader(mode)
    try:
        second.load_state_dict(saved, global_step=2)
        assert second.progress.consumed == first.progress.consumed and second.epoch_consumed == first.epoch_consumed
        second.set_epoch(0)
        list(second)
        rest = second.take_pending()
        trained = sorted(i for s in taken + rest for i in s.indices)
        # samples mode: the fixed-batch run's epoch, whose last global batch wraps around
        expected = (sorted(i for s in second.loader._fixed_batch_steps(0) for i in s.indices)
                    if mode.name == "samples" else list(range(len(LENGTHS))))
        assert trained == expected
        assert len(trained) == second.epoch_samples and second.progress.fraction == 1.0
    finally:
        second.loader.close()


def test_loss_weights_follow_the_tokens_of_a_packed_row_and_vanish_when_idle():
    step = SimpleNamespace(sample_weights=[0.5, 0.25], is_idle=False, data={"input_ids": torch.zeros(1, 5)})
    token_sample = torch.tensor([[0, 0, 1, 1, -1]])
    assert SamplesMode.loss_weights(step, token_sample).tolist() == [[0.5, 0.5, 0.25, 0.25, 0.0]]
    step.is_idle = True
    assert SamplesMode.loss_weights(step, token_sample).abs().sum() == 0
    padded = SimpleNamespace(sample_weights=[0.5, 0.25], is_idle=False, data={"input_ids": torch.zeros(2, 5)})
    assert SamplesMode.loss_weights(padded, None).tolist() == [0.5, 0.25]
    # float32 whatever torch's default dtype; an IDLE step trains one filler sample, weighing nothing
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert SamplesMode.loss_weights(padded, None).dtype == torch.float32
    finally:
        torch.set_default_dtype(default)
    padded.is_idle = True
    assert SamplesMode.loss_weights(padded, None).tolist() == [0.0]


def test_a_resumed_loader_maps_hf_epochs_onto_its_own():
    """HF restarts its epoch loop at global_step // updates_per_epoch; the loader, saved in a
    later epoch, shifts HF's epoch numbers by the difference, and keeps the epoch's consumed
    samples until its epoch changes."""
    first, _ = _train_loader(GroupsMode())
    try:
        first.set_epoch(3)
        for _ in first:
            if len(first.take_pending()) and first.epoch_consumed:
                break
        saved = first.state_dict()
    finally:
        first.loader.close()
    for updates_per_epoch, global_step, shift in ((2, 5, 1), (1, 1, 2), (0, 1, 2)):
        second, _ = _train_loader(GroupsMode())
        try:
            second.updates_per_epoch = updates_per_epoch
            second.load_state_dict(saved, global_step=global_step)
            assert second.epoch_shift == shift
            consumed = second.epoch_consumed
            assert consumed == saved["epoch_consumed"] > 0
            second.set_epoch(3 - shift)          # HF's epoch of the checkpoint: the loader's 3
            assert second.loader.epoch == 3 and second.epoch_consumed == consumed
            second.set_epoch(4 - shift)          # the next one starts from nothing
            assert second.loader.epoch == 4 and second.epoch_consumed == 0
        finally:
            second.loader.close()


def test_the_collate_masks_each_rows_first_label_only():
    """A shifted causal loss never reads a row's first label; masked, HF's label count equals
    the tokens the loss averages over."""
    from odb_factory.llamafactory.train_loader import LFCollate
    features = [{"labels": [5, 6, 7]}, {"labels": [8, 9, -100]}]
    batch = LFCollate(lambda rows: {"labels": torch.tensor([r["labels"] for r in rows]), "n": len(rows)})(features)
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]] and batch["n"] == 2
