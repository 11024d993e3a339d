"""What a recipe's `stage` changes in the dry run, decided as the training side decides it.

A stage's rows are built by LLaMA-Factory's processor of its data stage (`DATA_STAGES`: stage
dpo reads the chosen/rejected pairs of data stage rm) and padded by the stage's training
collator; a sample costs what the run's loader costs it (a dpo pair: `PairCost`, the two padded
rows of its longer side); and the settings a stage refuses are refused with training's own
messages (`arguments.stage_step_refusal`, `arguments.stage_padding_free_refusal`).

    stage = stage_of("dpo")
    stage.data_stage              # "rm"
    stage.cost_fn(config)         # a PairCost
    stage.step_refusal("groups")  # why groups mode cannot train pairs
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ..config import ODBConfig
from ..cost import CostFn, DefaultCost
from ..llamafactory import arguments
from ..llamafactory.lazy_dataset import PAIR_SIDES

# The multiple each stage's LLaMA-Factory collator pads a batch to, (do_train, otherwise); the
# run's loader reads it off the collator: sft's SFTDataCollatorWith4DAttentionMask 8 when
# training, pt's DataCollatorForLanguageModeling none, dpo's PairwiseDataCollatorWithPadding 8.
PAD_MULTIPLES = {"sft": (8, 1), "pt": (1, 1), "dpo": (8, 8)}


class Stage:
    """Stages sft and pt: a sample is one row."""

    rows_per_sample = 1

    def __init__(self, name: str):
        self.name = name
        self.data_stage = arguments.DATA_STAGES[name]

    def pad_multiple(self, do_train: bool) -> int:
        return PAD_MULTIPLES[self.name][0 if do_train else 1]

    def cost_fn(self, config: ODBConfig) -> CostFn:
        return DefaultCost.from_config(config)

    def rows(self, sample: Any) -> List[Sequence[int]]:
        """The input ids of the rows a processed sample is trained as."""
        return [sample["input_ids"]]

    def step_refusal(self, mode: str) -> Optional[str]:
        """Why training refuses `odb_step: mode` for this stage (None: it trains it)."""
        return arguments.stage_step_refusal(self.name, mode)

    def padding_free_refusal(self) -> Optional[str]:
        """Why training refuses padding-free rows for this stage (None: it trains them)."""
        return arguments.stage_padding_free_refusal(self.name)


class PairStage(Stage):
    """Stage dpo: a sample is a chosen/rejected pair, trained as two rows padded to its longer
    side (`odb_factory.llamafactory.pairwise`)."""

    rows_per_sample = 2

    def cost_fn(self, config: ODBConfig) -> CostFn:
        from ..llamafactory.pairwise import PairCost
        return PairCost(DefaultCost.from_config(config), config.pad_to_multiple_of)

    def rows(self, sample: Any) -> List[Sequence[int]]:
        return [sample[prefix + "input_ids"] for prefix, _ in PAIR_SIDES]


def stage_of(name: str) -> Stage:
    """The dry run's view of stage `name`, one of the stages ODB trains (`SUPPORTED_STAGES`)."""
    if name not in arguments.SUPPORTED_STAGES:
        raise ValueError(f"stage: {name}: the dry run plans the stages ODB trains, "
                         f"{', '.join(arguments.SUPPORTED_STAGES)}")
    return PairStage(name) if name in arguments.PAIRWISE_STAGES else Stage(name)
