"""The suggested `odb_token_budget`.

Rule: the candidates run from the longest row (rounded up to a multiple of 256) to 8 times
it. Never below the longest row: a row over the budget is trained alone at its own length, so
a smaller budget cannot lower the peak memory, it only adds lone micro-batches. For each
candidate the recipe's `odb_step` mode is planned again over the same rows with the engine's
planner and priced with the step model; a candidate with any micro-batch over the memory
figure (`--gpu-memory-gb`, default the step model's 96 GB H20) is out. The suggestion is the
smallest candidate within 1% of the fastest: a larger budget that buys less than that only
costs memory (and, in `groups` mode, fewer, larger optimizer steps).
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Sequence

from ..config import ODBConfig
from ..cost import SampleCost
from ..simulation.pricing import evaluate, features
from ..simulation.schedules import Schedule
from ..simulation.step_model import StepModel
from .report import Rows, schedule_for

GRID = 256                                  # budgets are suggested in multiples of this
FACTORS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)  # candidates: the longest row times these
TOLERANCE = 0.01                            # "as fast as the fastest" within this share
RULE = ("smallest budget within 1% of the step model's fastest, among 1-8x the longest row "
        "(multiples of 256; never below it, a longer row is trained alone anyway), planned in "
        "the recipe's odb_step mode, no micro-batch over the memory figure (--gpu-memory-gb)")


def candidates(longest: int) -> List[int]:
    return sorted({GRID * math.ceil(longest * f / GRID) for f in FACTORS})


def suggest(rows: Rows, config: ODBConfig, world: int, mode: str, standard: Schedule,
            costs: Sequence[SampleCost], model: StepModel, packed_attention: str = "segments",
            supervised_logits: bool = False) -> dict:
    longest = int(rows.tokens.max())
    tried = []
    for budget in candidates(longest):
        s = schedule_for(mode, dataclasses.replace(config, token_budget=budget), world, standard, costs)
        result = evaluate(features(s, rows, packed_attention, supervised_logits), rows, model)
        tried.append({"budget": budget, "samples_per_s": result.samples_per_s,
                      "micro_batches": s.micro_steps, "optimizer_steps": s.optimizer_steps,
                      "oom_batches": result.oom_batches})
    fitting = [t for t in tried if t["samples_per_s"] is not None]
    out = {"rule": RULE, "mode": mode, "longest_row_tokens": longest, "candidates": tried}
    if not fitting:
        return {**out, "value": None,
                "reason": "no candidate fits the memory figure: even the longest row's micro-batch "
                          "is over it (lower cutoff_len or image_max_pixels, or use more memory)"}
    fastest = max(t["samples_per_s"] for t in fitting)
    chosen = min(t["budget"] for t in fitting if t["samples_per_s"] >= (1 - TOLERANCE) * fastest)
    return {**out, "value": chosen}
