"""`ODBRun`, the value the adapter's parts share: handed on with LLaMA-Factory's argument
objects, and the run's sample progress."""

from __future__ import annotations

from types import SimpleNamespace

from odb_factory.llamafactory.arguments import parse_odb_arguments
from odb_factory.llamafactory.run import ODBRun, SampleProgress, attach, run_of
from odb_factory.llamafactory.step_modes import GroupsMode, SamplesMode


def test_progress_is_the_fraction_of_the_runs_samples_trained():
    progress = SampleProgress()
    assert progress.fraction == 0.0   # no sample count yet: nothing to divide by
    progress.consumed, progress.input_tokens = 7, 900
    progress.start(8)
    assert (progress.consumed, progress.total, progress.input_tokens) == (0, 8, 0)
    progress.consumed = 2
    assert progress.fraction == 0.25
    progress.consumed = 8
    assert progress.fraction == 1.0
    progress.consumed = 11   # the last global batch wraps around, as Standard's does
    assert progress.fraction == 1.0


def test_a_run_travels_with_every_argument_object_it_is_attached_to():
    enabled = ODBRun(parse_odb_arguments({"odb_enable": True, "odb_step": "groups"}))
    data_args, finetuning_args, other = SimpleNamespace(), SimpleNamespace(), SimpleNamespace()
    attach(enabled, data_args, finetuning_args)
    assert run_of(data_args) is enabled and run_of(finetuning_args) is enabled
    assert run_of(other) is None and run_of(other, enabled_only=False) is None
    assert isinstance(enabled.step_mode, GroupsMode) and enabled.enabled
    attach(None, data_args)   # the same arguments without ODB
    assert run_of(data_args) is None and run_of(finetuning_args) is enabled


def test_a_run_with_odb_keys_but_odb_enable_false_is_found_only_when_asked_for():
    disabled = ODBRun(parse_odb_arguments({"odb_enable": False, "odb_token_budget": 512}))
    args = SimpleNamespace()
    attach(disabled, args)
    assert not disabled.enabled
    assert run_of(args) is None
    assert run_of(args, enabled_only=False) is disabled
    assert isinstance(disabled.step_mode, SamplesMode)   # the default step mode
    assert disabled.progress == SampleProgress() and disabled.progress is not ODBRun(disabled.options).progress
