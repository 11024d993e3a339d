"""Per-step and cumulative loader metrics (what the trainer logs)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict

from ..config import LF_PREFIX, option_name

logger = logging.getLogger("odb_factory")

COUNTERS = ("steps", "samples", "input_tokens", "padded_tokens", "label_tokens", "splits",
            "overflow_groups", "idle_steps", "over_budget", "rounds", "data_wait_s")


@dataclass
class LoaderMetrics:
    totals: Dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    epoch_steps: Dict[int, int] = field(default_factory=dict)

    def record(self, plan, wait_s: float) -> Dict[str, float]:
        step = {
            "samples": float(len(plan.indices)),
            "input_tokens": float(plan.input_tokens),
            "padded_tokens": float(plan.padded_tokens),
            "label_tokens": float(plan.label_tokens),
            "padding_efficiency": plan.input_tokens / plan.padded_tokens if plan.padded_tokens else 0.0,
            "idle": float(plan.is_idle),
            "data_wait_s": wait_s,
            **plan.round_stats,
        }
        t = self.totals
        t["steps"] += 1
        t["samples"] += step["samples"]
        t["input_tokens"] += step["input_tokens"]
        t["padded_tokens"] += step["padded_tokens"]
        t["label_tokens"] += step["label_tokens"]
        t["idle_steps"] += step["idle"]
        t["data_wait_s"] += wait_s
        if set(plan.round_stats) - {"over_budget"}:
            t["rounds"] += 1
            # samples mode's rounds (optimizer steps) carry balance figures only
            for key in ("splits", "overflow_groups"):
                t[key] += plan.round_stats.get(key, 0.0)
        over_budget = plan.round_stats.get("over_budget", 0.0)
        if over_budget and not t["over_budget"]:  # the first of the run: once, then counted
            logger.warning("ODB: %d sample(s) of this rank cost more than %s on their own and train alone "
                           "(epoch %d, %s %d); each is counted in odb/over_budget_samples. Raise the budget, "
                           "lower cutoff_len or the image resolution, or set %s: error to refuse them",
                           int(over_budget), option_name("token_budget"), plan.epoch,
                           "round" if plan.round_stats.keys() - {"over_budget"} else "step", plan.round,
                           LF_PREFIX + "over_budget")
        t["over_budget"] += over_budget
        self.epoch_steps[plan.epoch] = self.epoch_steps.get(plan.epoch, 0) + 1
        return step

    def summary(self) -> Dict[str, float]:
        t = dict(self.totals)
        t["padding_efficiency"] = t["input_tokens"] / t["padded_tokens"] if t["padded_tokens"] else 0.0
        return t
