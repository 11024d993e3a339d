"""Target: the name `CustomTrainer` in llamafactory.train.pt.workflow (written for LLaMA-Factory
0.9.5).

`run_pt` (stage pt, continued pre-training) builds its trainer through this module-level name.
With ODB enabled (the run attached to its FinetuningArguments) it gets ODBTrainerMixin in front
of LLaMA-Factory's class, and the run; otherwise the upstream class itself.
"""

from __future__ import annotations


def apply() -> None:
    from llamafactory.train.pt import workflow

    from .llamafactory_trainer_name import replace_trainer_name
    replace_trainer_name(workflow, "CustomTrainer", "ODBPretrainTrainer")
