"""Target: the name `CustomTrainer` in llamafactory.train.pt.workflow (written for LLaMA-Factory
0.9.5).

`run_pt` (stage pt, continued pre-training) builds its trainer through this module-level name.
With ODB enabled (the run attached to its FinetuningArguments) it gets ODBTrainerMixin in front
of LLaMA-Factory's class, and the run; otherwise the upstream class itself.
"""

from __future__ import annotations


def apply() -> None:
    from llamafactory.train.pt import workflow

    upstream = workflow.CustomTrainer
    if getattr(upstream, "_odb_factory", False):
        return

    from odb_factory.llamafactory.run import run_of
    from odb_factory.llamafactory.trainer import ODBTrainerMixin

    odb_trainer = type("ODBPretrainTrainer", (ODBTrainerMixin, upstream), {})

    def CustomTrainer(*args, **kwargs):
        run = run_of(kwargs.get("finetuning_args"))
        if run is None:
            return upstream(*args, **kwargs)
        return odb_trainer(*args, odb_run=run, **kwargs)

    CustomTrainer._odb_factory = True
    workflow.CustomTrainer = CustomTrainer
