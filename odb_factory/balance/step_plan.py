"""Post-balancing of one aligned step: which rank trains which of the step's samples.

The gradient of a globally normalised loss does not depend on which rank computes which
sample, so after alignment each step's samples may be re-dealt across ranks to equalise
the LLM-stage cost (OrchMLLM's batch post-balancing). Pure and deterministic: every rank
computes the same plan from the same gathered costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..balance import QWEN3_VL_LLM, BalancePlan, StageCostModel, balance
from ..cost import SampleCost

BYTES_PER_TOKEN = 8  # token id + label, int32 each: what a pre-collate sample carries


@dataclass(frozen=True)
class StepBalance:
    mode: str = "padded"              # "padded" (padding collators), "lpt" (packed), "min_move"
    ranks_per_node: int = 1
    token_cap: Optional[int] = None   # no rank's padded tokens above this (the memory budget)
    tolerance: float = 0.02           # min_move: allowed excess over the lower bound
    pad_to_multiple_of: int = 1       # lengths are planned as the collator pads them
    cost_model: StageCostModel = QWEN3_VL_LLM


def plan_step(costs_per_rank: Sequence[Sequence[SampleCost]], spec: StepBalance) -> Optional[BalancePlan]:
    """The plan for one step, or None when it cannot be balanced within the caps (the step
    then runs as aligned)."""
    m = spec.pad_to_multiple_of
    lengths = [[-(-c.input_tokens // m) * m for c in rank] for rank in costs_per_rank]
    sizes = [[c.input_tokens * BYTES_PER_TOKEN for c in rank] for rank in costs_per_rank]
    if sum(map(len, lengths)) == 0:
        return None
    kwargs = dict(ranks_per_node=spec.ranks_per_node, mode=spec.mode, sizes_per_rank=sizes)
    if spec.mode == "padded":
        kwargs.update(lengths_per_rank=lengths, cost_model=spec.cost_model)
        costs = lengths
    else:
        costs = [[float(spec.cost_model(l)) for l in rank] for rank in lengths]
        if spec.mode == "min_move":
            kwargs["tolerance"] = spec.tolerance
    if spec.token_cap is not None:
        kwargs["max_padded_tokens_per_rank"] = spec.token_cap
        kwargs.setdefault("lengths_per_rank", lengths)  # padded mode has set them already
    try:
        return balance(costs, **kwargs)
    except ValueError:
        return None  # infeasible under the caps
