"""Target: the name `CustomSeq2SeqTrainer` in llamafactory.train.sft.workflow (written for
LLaMA-Factory 0.9.5 on transformers 5.6.0).

`run_sft` builds its trainer through this module-level name. With ODB enabled it gets
ODBTrainerMixin in front of LLaMA-Factory's class; otherwise the upstream class itself.
"""

from __future__ import annotations


def apply() -> None:
    from llamafactory.train.sft import workflow

    upstream = workflow.CustomSeq2SeqTrainer
    if getattr(upstream, "_odb_factory", False):
        return

    from odb_factory.llamafactory import state
    from odb_factory.llamafactory.trainer import ODBTrainerMixin

    odb_trainer = type("ODBSeq2SeqTrainer", (ODBTrainerMixin, upstream), {})

    def CustomSeq2SeqTrainer(*args, **kwargs):
        cls = odb_trainer if state.active() is not None else upstream
        return cls(*args, **kwargs)

    CustomSeq2SeqTrainer._odb_factory = True
    workflow.CustomSeq2SeqTrainer = CustomSeq2SeqTrainer
