"""Target: the names `CustomSeq2SeqTrainer` and `calculate_tps` in
llamafactory.train.sft.workflow (written for LLaMA-Factory 0.9.5 on transformers 5.6.0).

`run_sft` builds its trainer through this module-level name. With ODB enabled (the run
attached to its FinetuningArguments) it gets ODBTrainerMixin in front of LLaMA-Factory's
class, and the run; otherwise the upstream class itself.

`include_effective_tokens_per_second` makes `run_sft` call `calculate_tps`, which iterates
the training set to count its tokens: on ODB's lazy dataset that would run the whole
per-sample pipeline once more, after training. The ODB trainer's metrics carry the input
tokens every rank trained (`ODB_INPUT_TOKENS`), which it reads instead (the same figure:
every rank's trained input tokens over the runtime, per rank).
"""

from __future__ import annotations


def apply() -> None:
    from llamafactory.train.sft import workflow

    from odb_factory.llamafactory.trainer import ODB_INPUT_TOKENS

    from .llamafactory_trainer_name import replace_trainer_name
    if not replace_trainer_name(workflow, "CustomSeq2SeqTrainer", "ODBSeq2SeqTrainer"):
        return

    upstream_tps = workflow.calculate_tps

    def calculate_tps(dataset, metrics, stage):
        if ODB_INPUT_TOKENS not in metrics or stage != "sft":
            return upstream_tps(dataset, metrics, stage)
        import torch.distributed as dist
        world = dist.get_world_size() if dist.is_initialized() else 1
        return float(metrics[ODB_INPUT_TOKENS]) / metrics["train_runtime"] / world

    workflow.calculate_tps = calculate_tps
