"""Encoder-stage balancing figures for the trainer's logs: per stage (vision, audio), the
slowest rank's encoder cost over the lower bound before and after balancing (averaged over
the forwards since the last log line), the items moved and the bytes this rank sent."""

from __future__ import annotations

import sys
from typing import Dict

# stage -> the patch module whose `balancer()` runs it
PATCHES = {"vision": "odb_factory_patches.transformers_qwen3_vl",
           "audio": "odb_factory_patches.transformers_qwen2_5_omni"}
SENT = {"vision": ("pixel_bytes_sent", "embed_bytes_sent"),
        "audio": ("frame_bytes_sent", "embed_bytes_sent")}


class EncoderStageMetrics:
    def __init__(self) -> None:
        self.logged_steps: Dict[str, int] = {}

    def pop(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for stage, module_name in PATCHES.items():
            module = sys.modules.get(module_name)
            balancer = module.balancer() if module is not None else None
            if balancer is None:
                continue
            new = balancer.step - self.logged_steps.get(stage, 0)
            self.logged_steps[stage] = balancer.step
            calls = [h for h in balancer.history[-new:] if h.get("items")] if new > 0 else []
            if not calls:
                continue
            for key in ("max_over_lb_before", "max_over_lb_after"):
                out[f"odb/{stage}_{key}"] = round(sum(h[key] for h in calls) / len(calls), 4)
            out[f"odb/{stage}_moved_items"] = float(sum(h["moved_items"] for h in calls))
            out[f"odb/{stage}_bytes_sent"] = float(sum(h[k] for h in calls for k in SENT[stage]))
        return out
