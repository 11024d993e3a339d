"""The two step modes, one strategy each: what the parser, the trainer and the train loader ask
of them, method by method (the stock-CLI runs in tests/llamafactory/test_e2e*.py and
test_samples_mode.py show the strategies train the right model; these pin each decision).

The trainer, its arguments and its loader are stood in by the few attributes a method reads."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from odb_factory import ODBConfig
from odb_factory.llamafactory.arguments import parse_odb_arguments
from odb_factory.llamafactory.run import ODBRun, SampleProgress
from odb_factory.llamafactory.step_modes import (CPU_SAMPLES_TOKEN_BUDGET, GroupsMode, OptimizerStepBatch,
                                                 SamplesMode, micro_batches_of, sample_progress_lambda,
                                                 step_mode, token_sum_loss)
from odb_factory.loader import ODBBatch
from odb_factory.planning.optimizer_steps import StandardStep


@pytest.fixture
def odb_log(caplog):
    caplog.set_level(logging.WARNING, logger="odb_factory")
    return caplog


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "odb_factory"]


def test_each_name_gives_its_strategy_and_another_name_is_refused():
    assert type(step_mode("samples")) is SamplesMode and type(step_mode("groups")) is GroupsMode
    assert step_mode("groups") is not step_mode("groups")   # a fresh strategy per run
    with pytest.raises(ValueError) as raised:
        step_mode("pairs")
    assert str(raised.value) == "odb_step: 'pairs' is not one of ['samples', 'groups']"
    assert (SamplesMode.hf_counts_steps, GroupsMode.hf_counts_steps) == (True, False)


def test_samples_mode_hands_hf_an_accumulation_of_one_and_keeps_the_recipes_for_the_engine():
    options = parse_odb_arguments({"odb_enable": True})
    raw = {"gradient_accumulation_steps": 4, "learning_rate": 1e-4}
    assert SamplesMode().lf_arguments(options, raw) == {"gradient_accumulation_steps": 1, "learning_rate": 1e-4}
    assert raw["gradient_accumulation_steps"] == 4   # the recipe itself is not changed
    assert options.config.gradient_accumulation_steps == 4
    assert SamplesMode().engine_accumulation(options.config, hf_accumulation=1) == 4

    without = parse_odb_arguments({"odb_enable": True})
    assert SamplesMode().lf_arguments(without, {})["gradient_accumulation_steps"] == 1
    assert without.config.gradient_accumulation_steps == 1   # the recipe's default

    kept = {"gradient_accumulation_steps": 4}
    handed = GroupsMode().lf_arguments(options, kept)
    assert handed == kept and handed is not kept
    assert GroupsMode().engine_accumulation(ODBConfig(gradient_accumulation_steps=2), hf_accumulation=4) == 4


def test_the_loss_each_mode_computes(odb_log):
    samples, groups = SamplesMode(), GroupsMode()
    assert samples.loss_scaling("standard", "micro_mean") == "micro_mean"
    assert samples.loss_scaling("exact", "exact") == "exact"
    assert _messages(odb_log) == []
    assert samples.loss_scaling("exact", "micro_mean") == "exact"
    assert _messages(odb_log) == [
        "ODB: odb_loss_scaling: exact differs from the loss the fixed-batch run computes for this model "
        "(micro_mean): the same samples, another weighting of their tokens"]
    assert groups.loss_scaling("standard", "micro_mean") == "exact"
    assert groups.loss_scaling("micro_mean", "exact") == "micro_mean"
    assert groups.loss_function("exact") is token_sum_loss
    assert groups.loss_function("micro_mean") is None
    assert samples.loss_function("exact") is None


def test_samples_mode_warns_when_a_step_holds_one_sample(odb_log):
    SamplesMode().describe(per_device_batch=2, accumulation=1)
    SamplesMode().describe(per_device_batch=1, accumulation=2)
    SamplesMode().describe(per_device_batch=2, accumulation=2)
    assert _messages(odb_log) == []
    SamplesMode().describe(per_device_batch=1, accumulation=1)
    assert _messages(odb_log) == [
        "ODB: odb_step: samples with one sample per rank and optimizer step leaves nothing to group: the run "
        "is the fixed-batch run. Raise gradient_accumulation_steps (the same global batch in fewer, fuller "
        "micro-batches) or use odb_step: groups"]


def test_groups_mode_says_what_an_optimizer_step_holds(odb_log):
    GroupsMode().describe(per_device_batch=2, accumulation=4)
    GroupsMode().describe(per_device_batch=3, accumulation=1)
    assert _messages(odb_log) == [
        "ODB: odb_step: groups: every optimizer step holds 4 token-budgeted groups per rank, not the "
        "recipe's 8 samples per rank; the number of samples per optimizer step is logged as "
        "odb/samples_per_optimizer_step",
        "ODB: odb_step: groups: every optimizer step holds 1 token-budgeted group per rank, not the "
        "recipe's 3 samples per rank; the number of samples per optimizer step is logged as "
        "odb/samples_per_optimizer_step"]


def test_auto_budget_and_auto_balance_follow_the_mode_and_the_device():
    samples, groups = SamplesMode(), GroupsMode()
    budget, why = samples.auto_token_budget(on_cpu=True, default=4096)
    assert budget == CPU_SAMPLES_TOKEN_BUDGET == 1024 and why == (
        "odb_token_budget: auto, odb_step: samples on CPU, where a packed row costs more per token once memory "
        "runs short; the model is the same")
    assert samples.auto_token_budget(on_cpu=False, default=4096) == (
        4096, "odb_token_budget: auto, odb_step: samples on an accelerator")
    assert groups.auto_token_budget(on_cpu=True, default=4096) == (
        4096, "odb_token_budget: auto, odb_step: groups (the budget makes the optimizer steps, so it does not "
              "follow the device)")
    assert groups.auto_token_budget(on_cpu=False, default=2048)[0] == 2048

    assert samples.auto_balance(1) == (False, "odb_balance: auto, one rank: nothing to re-deal")
    on, why = samples.auto_balance(2)
    assert on is True and why.startswith("odb_balance: auto, odb_step: samples on 2 ranks: ")
    assert groups.auto_balance(8) == (
        False, "odb_balance: auto, odb_step: groups (set odb_balance: true to post-balance its groups)")


def test_the_epoch_each_mode_trains():
    steps = [StandardStep(((0, 1), (2, 3))), StandardStep(((4, 5), (6,)))]
    asked = []
    trainer = SimpleNamespace(args=SimpleNamespace(world_size=3),
                              _odb_standard_steps=lambda epoch: asked.append(epoch) or steps)
    # samples: the fixed-batch run's first epoch, 7 samples per rank
    assert SamplesMode().epoch_extent(trainer, ODBConfig(), dataset_size=100) == (21, 2)
    assert asked == [0]
    assert SamplesMode().standard_steps(trainer) is trainer._odb_standard_steps
    assert GroupsMode().standard_steps(trainer) is None
    # groups: the dataset, or a non-join epoch's quota
    groups = GroupsMode()
    assert groups.epoch_extent(trainer, ODBConfig(), dataset_size=100) == (100, 0)
    assert groups.epoch_extent(trainer, ODBConfig(join=False, quota=30), dataset_size=100) == (30, 0)
    assert groups.epoch_extent(trainer, ODBConfig(join=False), dataset_size=100) == (100, 0)


def _groups_run(token_budget, cost_mode, total):
    run = ODBRun(parse_odb_arguments({"odb_enable": True, "odb_step": "groups", "odb_token_budget": token_budget,
                                      "odb_cost_mode": cost_mode}))
    run.progress.start(total)
    return run


def test_groups_mode_estimates_its_steps_from_a_probe_of_the_dataset():
    # 50 samples: the probe reads every 50 // 16 = 3rd, the first 16 such, all 100 tokens long;
    # any other sample would move the mean
    lengths = [100 if i % 3 == 0 and i < 48 else 1000 for i in range(50)]
    loader = SimpleNamespace(dataset=[{"input_ids": [1] * n} for n in lengths])
    args = SimpleNamespace(world_size=2, gradient_accumulation_steps=1)
    # padded groups fill 0.8 of the budget: 8 samples per group, 16 per micro-step on 2 ranks
    assert GroupsMode.estimate_steps(loader, args, _groups_run(1000, "padded", 40)) == 3   # ceil(2.5)
    assert GroupsMode.estimate_steps(loader, args, _groups_run(1000, "packed", 40)) == 2   # 10 per group
    args.gradient_accumulation_steps = 2
    assert GroupsMode.estimate_steps(loader, args, _groups_run(1000, "padded", 40)) == 2   # ceil(1.25)
    # fewer than 32 samples: the probe reads the first 16
    small = SimpleNamespace(dataset=[{"input_ids": [1] * (100 if i < 16 else 1000)} for i in range(20)])
    assert GroupsMode.estimate_steps(small, args, _groups_run(1000, "padded", 40)) == 2
    # a budget below one sample still counts one sample per group, and a run has a step
    args = SimpleNamespace(world_size=1, gradient_accumulation_steps=1)
    assert GroupsMode.estimate_steps(loader, args, _groups_run(50, "packed", 40)) == 40
    assert GroupsMode.estimate_steps(loader, args, _groups_run(1000, "packed", 0)) == 1
    # one sample of 4 tokens: 2.5 per group; samples of one token: the budget's 10
    one = SimpleNamespace(dataset=[{"input_ids": [1] * 4}])
    assert GroupsMode.estimate_steps(one, args, _groups_run(10, "packed", 40)) == 16
    single_tokens = SimpleNamespace(dataset=[{"input_ids": [1]}] * 3)
    assert GroupsMode.estimate_steps(single_tokens, args, _groups_run(10, "packed", 40)) == 4


def test_groups_mode_hands_hf_its_step_bound_and_the_runs_sample_count():
    run = _groups_run(1000, "padded", 40)
    args = SimpleNamespace(max_steps=-1, num_train_epochs=2.5, gradient_accumulation_steps=4, world_size=2)
    loader = SimpleNamespace(dataset=[{"input_ids": [1] * 100}] * 40, steps_upper_bound=lambda: 13)
    trainer = SimpleNamespace(odb_run=run, get_total_train_batch_size=lambda given: 16 if given is args else None)
    upstream = lambda: pytest.fail("groups mode counts its own steps")   # noqa: E731
    # transformers 5: (epochs, updates per epoch, examples, samples, total batch, bound, max steps)
    assert GroupsMode().initial_training_values(trainer, args, loader, upstream, transformers_4=False) == (
        3, 3, 40, 40, 16, 13, 1)
    assert loader.updates_per_epoch == 3 and type(loader.updates_per_epoch) is int
    # transformers 4.57: the fifth is whether the epochs are counted (no max_steps: HF's max_steps < 0)
    assert GroupsMode().initial_training_values(trainer, args, loader, upstream, transformers_4=True) == (
        3, 3, 40, 40, True, 13, 1)
    args.max_steps = 0   # not set either, and HF's epochs are not counted
    assert GroupsMode().initial_training_values(trainer, args, loader, upstream, transformers_4=True) == (
        3, 3, 40, 40, False, 13, 1)
    for max_steps in (1, 5):
        args.max_steps = max_steps
        epochs, _, _, samples, counted, _, steps = GroupsMode().initial_training_values(
            trainer, args, loader, upstream, transformers_4=True)
        assert (samples, counted, steps) == (max_steps * 16, False, max_steps) and epochs > 10 ** 9


def test_samples_mode_takes_hfs_own_count_and_tells_the_loader():
    loader = SimpleNamespace()
    values = (2, 7, 40, 80, 8, 7, 14)
    assert SamplesMode().initial_training_values(None, None, loader, lambda: values, transformers_4=False) is values
    assert loader.updates_per_epoch == 7


def _lambda_lr(factor):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def test_groups_mode_schedules_by_sample_progress(odb_log):
    progress = SampleProgress()
    progress.start(40)
    linear = lambda step: 1.0 - step / 100   # noqa: E731
    scheduler = _lambda_lr(linear)
    assert GroupsMode().schedule(scheduler, 100, SimpleNamespace(max_steps=0), progress) is scheduler
    progress.consumed = 10
    assert scheduler.lr_lambdas[0](3) == pytest.approx(0.75)   # a quarter of the samples, whatever the step
    progress.consumed = 40
    assert scheduler.lr_lambdas[0](3) == pytest.approx(0.0)
    # max_steps: the steps are known, the schedule stays HF's
    kept = _lambda_lr(linear)
    assert GroupsMode().schedule(kept, 100, SimpleNamespace(max_steps=5), progress).lr_lambdas == [linear]
    assert GroupsMode().schedule(kept, 100, SimpleNamespace(max_steps=1), progress).lr_lambdas == [linear]
    assert SamplesMode().schedule(kept, 100, SimpleNamespace(max_steps=0), progress).lr_lambdas == [linear]
    assert _messages(odb_log) == []
    # a scheduler without lambdas keeps its own schedule, and the user is told
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert GroupsMode().schedule(step_lr, 100, SimpleNamespace(max_steps=0), progress) is step_lr
    assert _messages(odb_log) == ["ODB: StepLR is not a LambdaLR; its schedule follows optimizer steps "
                                  "(an estimate with variable batches)"]


def test_a_sample_progress_lambda_reads_the_progress_when_called():
    progress = SampleProgress()
    seen = []
    lr = sample_progress_lambda(lambda step: seen.append(step) or step / 10, num_training_steps=20,
                                progress=progress)
    assert lr(7) == 0.0 and seen == [0.0]   # no sample count yet
    progress.start(8)
    progress.consumed = 2
    assert lr(7) == 0.5 and seen == [0.0, 5.0]


def test_an_optimizer_step_batch_counts_the_tokens_of_all_its_micro_batches():
    first = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.tensor([[1, 1, 0]]),
             "labels": torch.tensor([[-100, 2, 3]])}
    second = {"input_ids": torch.tensor([[4], [5]]), "attention_mask": torch.tensor([[1], [1]]),
              "labels": torch.tensor([[4], [5]])}
    step = OptimizerStepBatch([first, second])
    assert step["input_ids"].tolist() == [1, 2, 3, 4, 5]
    assert step["attention_mask"].tolist() == [1, 1, 0, 1, 1]
    assert "input_ids" in step and "attention_mask" in step
    assert "labels" not in step   # HF counts no labels: the sample weights normalise the loss
    with pytest.raises(KeyError) as missing:
        step["labels"]
    assert missing.value.args == ("labels",)
    without_mask = OptimizerStepBatch([first, {"input_ids": torch.tensor([[4]])}])
    assert "attention_mask" not in without_mask and "input_ids" in without_mask
    assert micro_batches_of(step) == [first, second]
    assert micro_batches_of(first) == [first]


def _step(end, idle=False, weights=(0.5,)):
    return ODBBatch(data=None, indices=[] if idle else list(range(len(weights))), label_tokens=1,
                    global_label_tokens=1, loss_scale=1.0, is_idle=idle, epoch=0, step=0,
                    sample_weights=list(weights), optimizer_step_end=end)


def test_each_mode_hands_hf_its_batches():
    batches = [{"input_ids": torch.tensor([[i]])} for i in range(3)]
    steps = list(zip([_step(False), _step(True), _step(True)], batches))
    assert list(GroupsMode().hf_batches(iter(steps))) == batches
    handed = list(SamplesMode().hf_batches(iter(steps)))
    assert [len(b.micro_batches) for b in handed] == [2, 1]
    assert handed[0].micro_batches == batches[:2]
    assert [b["odb_sample_weights"].tolist() for b in batches] == [[0.5], [0.5], [0.5]]


def test_each_mode_tells_hf_how_long_an_epoch_is():
    loader = SimpleNamespace(steps_per_epoch=6, steps_upper_bound=lambda: 9)
    assert SamplesMode().epoch_length(loader) == 6
    assert GroupsMode().epoch_length(loader) == 9


def test_only_samples_mode_trains_preference_pairs():
    assert SamplesMode().pairs_refusal() is None
    assert GroupsMode().pairs_refusal() == ("a DPO loss is a mean over pairs, which a token-budgeted window "
                                            "of groups does not weigh")


def test_groups_mode_keeps_hfs_training_step():
    calls = []
    upstream = lambda model, inputs, n: calls.append((model, inputs, n)) or 2.0   # noqa: E731
    assert GroupsMode().training_step(None, "model", "inputs", upstream, 7) == 2.0
    assert calls == [("model", "inputs", 7)]


def test_a_packed_micro_batch_gets_a_weight_per_token():
    from odb_factory.llamafactory.padding_free import TOKEN_SAMPLE_KEY
    step = _step(True, weights=[0.5, 0.25])
    batch = {"input_ids": torch.zeros(1, 5, dtype=torch.long), TOKEN_SAMPLE_KEY: torch.tensor([[0, 0, 1, 1, -1]])}
    (handed,) = SamplesMode().hf_batches(iter([(step, batch)]))
    assert handed.micro_batches[0]["odb_sample_weights"].tolist() == [[0.5, 0.5, 0.25, 0.25, 0.0]]


@pytest.mark.parametrize("deepspeed", [False, True], ids=["ddp", "deepspeed"])
def test_samples_mode_runs_a_steps_micro_batches_and_syncs_gradients_on_the_last(monkeypatch, deepspeed):
    """HF accumulates over 1: the step's micro-batches run in one training_step; DDP skips the
    gradient all-reduce (no_sync) but on the last; DeepSpeed reads the sync flag instead."""
    import contextlib

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType
    # accelerate's state is process-wide: this test's lives in fresh dicts, the prior ones come back after
    for shared in (PartialState, AcceleratorState, GradientState):
        monkeypatch.setattr(shared, "_shared_state", {})
    accelerator = Accelerator(cpu=True)
    if deepspeed:
        monkeypatch.setattr(accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    model, seen, unsynced = torch.nn.Linear(1, 1), [], []
    real_no_sync = accelerator.no_sync

    @contextlib.contextmanager
    def no_sync(model=None):   # the real one, noting which model it holds back
        unsynced.append(model)
        with real_no_sync(model=model):
            yield
        unsynced.pop()

    monkeypatch.setattr(accelerator, "no_sync", no_sync)

    def upstream(given, batch, num_items):
        seen.append((given is model, batch["i"], accelerator.gradient_state.sync_gradients, list(unsynced), num_items))
        return torch.tensor(float(batch["i"]))

    step = OptimizerStepBatch([{"i": 1}, {"i": 2}, {"i": 3}])
    total = SamplesMode().training_step(SimpleNamespace(accelerator=accelerator), model, step, upstream,
                                        num_items_in_batch=99)
    # each micro-batch's loss is its weighted share of the step's: the step's loss is their sum
    assert float(total) == 6.0
    held_back = [] if deepspeed else [model]
    assert seen == [(True, 1, False, held_back, None), (True, 2, False, held_back, None), (True, 3, True, [], None)]
