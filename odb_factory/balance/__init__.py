"""Cross-rank batch post-balancing: pure, deterministic planning.

``balance(costs_per_rank, ...)`` returns a ``BalancePlan`` saying which rank processes which
sample. See docs/balancing.md for the modes and their guarantees.
"""

from .cost_model import (QWEN3_VL_LLM, QWEN3_VL_VISION, VISION_BY_PATCH_TOTAL, StageCostFit, StageCostModel,
                         fit_stage_cost_model)
from .lpt import lpt_groups
from .padded import padded_groups
from .placement import PLACEMENTS
from .assignment import MODES, BalancePlan, balance

__all__ = [
    "MODES", "PLACEMENTS", "QWEN3_VL_LLM", "QWEN3_VL_VISION", "VISION_BY_PATCH_TOTAL", "BalancePlan", "StageCostFit",
    "StageCostModel", "balance", "fit_stage_cost_model", "lpt_groups", "padded_groups",
]
