"""Target: the name `CustomDPOTrainer` in llamafactory.train.dpo.trainer (written for
LLaMA-Factory 0.9.5).

`run_dpo` (stage dpo) imports its trainer class from this module when it builds the trainer.
With ODB enabled (the run attached to its FinetuningArguments) it gets ODBPairwiseTrainerMixin
in front of LLaMA-Factory's class, and the run; otherwise the upstream class itself.
"""

from __future__ import annotations


def apply() -> None:
    from llamafactory.train.dpo import trainer

    from odb_factory.llamafactory.pairwise import ODBPairwiseTrainerMixin

    from .llamafactory_trainer_name import replace_trainer_name
    replace_trainer_name(trainer, "CustomDPOTrainer", "ODBDPOTrainer", mixin=ODBPairwiseTrainerMixin)
