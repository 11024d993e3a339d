"""Per-step and cumulative loader metrics (what the trainer logs)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict

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
        if plan.round_stats:
            t["rounds"] += 1
            # samples mode's rounds (optimizer steps) carry balance figures only
            for key in ("splits", "overflow_groups", "over_budget"):
                t[key] += plan.round_stats.get(key, 0.0)
            if plan.round_stats.get("over_budget"):
                logger.warning("ODB: %d sample(s) exceed the token budget on their own and are "
                               "trained as singletons (epoch %d, round %d)",
                               int(plan.round_stats["over_budget"]), plan.epoch, plan.round)
        self.epoch_steps[plan.epoch] = self.epoch_steps.get(plan.epoch, 0) + 1
        return step

    def summary(self) -> Dict[str, float]:
        t = dict(self.totals)
        t["padding_efficiency"] = t["input_tokens"] / t["padded_tokens"] if t["padded_tokens"] else 0.0
        return t
