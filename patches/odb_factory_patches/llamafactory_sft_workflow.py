"""Target: the names `CustomSeq2SeqTrainer` and `calculate_tps` in
llamafactory.train.sft.workflow (written for LLaMA-Factory 0.9.5 on transformers 5.6.0).

`run_sft` builds its trainer through this module-level name. With ODB enabled it gets
ODBTrainerMixin in front of LLaMA-Factory's class; otherwise the upstream class itself.

`include_effective_tokens_per_second` makes `run_sft` call `calculate_tps`, which iterates
the training set to count its tokens: on ODB's lazy dataset that would run the whole
per-sample pipeline once more, after training. With ODB it reads the tokens the loader
counted instead (the same figure: every rank's trained input tokens over the runtime, per
rank).
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

    upstream_tps = workflow.calculate_tps

    def calculate_tps(dataset, metrics, stage):
        if state.active() is None or stage != "sft":
            return upstream_tps(dataset, metrics, stage)
        import torch
        import torch.distributed as dist
        tokens = torch.tensor(float(state.progress.input_tokens), dtype=torch.float64)
        world = 1
        if dist.is_initialized():
            if dist.get_backend() == "nccl":
                tokens = tokens.cuda()
            dist.all_reduce(tokens)
            world = dist.get_world_size()
        return float(tokens) / metrics["train_runtime"] / world

    workflow.calculate_tps = calculate_tps
