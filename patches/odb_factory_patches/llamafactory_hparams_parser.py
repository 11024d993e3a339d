"""Target: llamafactory.hparams.parser._parse_train_args and _parse_train_mca_args (written
for LLaMA-Factory 0.9.5).

`get_train_args` looks this function up at call time, so wrapping it adds the `odb_*` keys
as their own dataclass without touching LLaMA-Factory's (TrainingArguments is pickled into
checkpoints and must not grow fields). Validation runs on the raw keys, before
LLaMA-Factory builds TrainingArguments and, with it, the process group. The run's `ODBRun`
travels on with the DataArguments and FinetuningArguments it returns (`run.attach`): the
data-loader patch and the trainer read it there.
"""

from __future__ import annotations

import functools


def apply(unsupported: str | None = None) -> None:
    from llamafactory.hparams import parser

    original = parser._parse_train_args
    if getattr(original, "_odb_wrapped", False):
        return

    @functools.wraps(original)
    def _parse_train_args(args=None):
        from odb_factory.llamafactory import arguments
        from odb_factory.llamafactory.run import ODBRun, attach
        if not isinstance(args, dict):
            return original(args)
        rest, ours = arguments.split_odb_keys(args)
        if not ours:
            return original(args)
        if unsupported is not None:
            raise RuntimeError(f"odb_* keys cannot be used: {unsupported}")
        run = ODBRun(arguments.parse_odb_arguments(ours))
        arguments.check_compatible(run.options, rest)
        if run.enabled:
            arguments.settle_stage(run.options, rest)
            arguments.check_paths(rest)
            arguments.check_model(run.options, rest)
            rest = arguments.stage_arguments(run.step_mode.lf_arguments(run.options, rest))
        parsed = original(rest)
        _model, data_args, _training, finetuning_args, _generating = parsed
        attach(run, data_args, finetuning_args)
        return parsed

    _parse_train_args._odb_wrapped = True
    parser._parse_train_args = _parse_train_args

    mca = getattr(parser, "_parse_train_mca_args", None)
    if mca is not None:
        @functools.wraps(mca)
        def _parse_train_mca_args(args=None):
            from odb_factory.llamafactory import arguments
            if isinstance(args, dict) and arguments.split_odb_keys(args)[1]:
                raise ValueError("odb_* keys with USE_MCA=1: Megatron-Core (MCA) training runs its own "
                                 "trainer and data path, which ODB does not hook; remove the odb_* keys "
                                 "or unset USE_MCA")
            return mca(args)

        parser._parse_train_mca_args = _parse_train_mca_args
