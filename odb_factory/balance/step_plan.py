"""Post-balancing of one aligned step: which rank trains which of the step's samples.

The gradient of a globally normalised loss does not depend on which rank computes which
sample, so after alignment each step's samples may be re-dealt across ranks to equalise
the LLM-stage cost (OrchMLLM's batch post-balancing). Packed steps (modes lpt, min_move) add
each sample's vision-encoder cost, which runs on the rank that trains the sample; padded steps
balance the padded LLM cost alone. Pure and deterministic: every rank computes the same plan
from the same gathered costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..balance import QWEN3_VL_LLM, VISION_BY_PATCH_TOTAL, BalancePlan, StageCostModel, balance
from ..comm.topology import ranks_per_node
from ..config import ODBConfig
from ..cost import SampleCost, padded_length

BYTES_PER_TOKEN = 8  # token id + label, int32 each: what a pre-collate sample carries


@dataclass(frozen=True)
class StepBalance:
    mode: str = "padded"              # "padded" (padding collators), "lpt" (packed), "min_move"
    ranks_per_node: int = 1
    token_budget: Optional[int] = None   # no rank's padded tokens above this (the memory budget)
    tolerance: float = 0.02           # min_move: allowed excess over the lower bound
    pad_to_multiple_of: int = 1       # lengths are planned as the collator pads them
    cost_model: StageCostModel = QWEN3_VL_LLM
    # packed modes: a sample's vision-encoder cost from its patch total, in cost_model's unit;
    # None leaves the encoder out
    vision_cost_model: Optional[StageCostModel] = VISION_BY_PATCH_TOTAL


def step_balance_of(config: ODBConfig, world_size: int) -> StepBalance:
    """The post-balancing a run of `config` does on `world_size` ranks (padded groups keep
    within the token budget; packed ones are costed by their tokens)."""
    return StepBalance(mode=config.balance_mode, ranks_per_node=ranks_per_node(config.ranks_per_node, world_size),
                       token_budget=config.token_budget if config.cost_mode == "padded" else None,
                       tolerance=config.balance_tolerance, pad_to_multiple_of=config.pad_to_multiple_of)


def plan_step(costs_per_rank: Sequence[Sequence[SampleCost]], spec: StepBalance) -> Optional[BalancePlan]:
    """The plan for one step, or None when it cannot be balanced within the caps (the step
    then runs as aligned)."""
    lengths = [[padded_length(c.input_tokens, spec.pad_to_multiple_of) for c in rank] for rank in costs_per_rank]
    sizes = [[c.input_tokens * BYTES_PER_TOKEN for c in rank] for rank in costs_per_rank]
    if sum(map(len, lengths)) == 0:
        return None
    kwargs = dict(ranks_per_node=spec.ranks_per_node, mode=spec.mode, sizes_per_rank=sizes)
    if spec.mode == "padded":
        kwargs.update(lengths_per_rank=lengths, cost_model=spec.cost_model)
        costs = lengths
    else:
        costs = [[float(spec.cost_model(l)) + vision_cost(c, spec.vision_cost_model) for l, c in zip(ls, rank)]
                 for ls, rank in zip(lengths, costs_per_rank)]
        if spec.mode == "min_move":
            kwargs["tolerance"] = spec.tolerance
    if spec.token_budget is not None:
        kwargs["token_budget"] = spec.token_budget
        kwargs.setdefault("lengths_per_rank", lengths)  # padded mode has set them already
    try:
        return balance(costs, **kwargs)
    except ValueError:
        return None  # infeasible under the caps


def vision_cost(cost: SampleCost, model: Optional[StageCostModel]) -> float:
    """The vision encoder's cost of one sample (0 without patches or without a model)."""
    return float(model(cost.vision_patches)) if model is not None and cost.vision_patches else 0.0
