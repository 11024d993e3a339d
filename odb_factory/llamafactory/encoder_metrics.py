"""Encoder-stage balancing figures for the trainer's logs: per stage (vision, audio), the
slowest rank's encoder cost over the lower bound before and after balancing (averaged over
the forwards since the last log line), the items moved and the bytes this rank sent."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Dict, List, Tuple

SENT = MappingProxyType({"vision": ("pixel_bytes_sent", "embed_bytes_sent"),
                         "audio": ("frame_bytes_sent", "embed_bytes_sent")})


class EncoderStageMetrics:
    def __init__(self) -> None:
        self.logged_steps: Dict[str, int] = {}
        # (stage, balancer) of the encoder-stage patch the trainer applied (none: no figures)
        self.balancers: List[Tuple[str, Any]] = []

    def pop(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for stage, balancer in self.balancers:
            new = balancer.step - self.logged_steps.get(stage, 0)
            self.logged_steps[stage] = balancer.step
            recent = balancer.history[-new:] if new > 0 else []
            calls = [s for s in (h.summary() for h in recent) if s.get("items")]
            if not calls:
                continue
            for key in ("max_over_lb_before", "max_over_lb_after"):
                out[f"odb/{stage}_{key}"] = round(sum(h[key] for h in calls) / len(calls), 4)
            out[f"odb/{stage}_moved_items"] = float(sum(h["moved_items"] for h in calls))
            out[f"odb/{stage}_bytes_sent"] = float(sum(h[k] for h in calls for k in SENT[stage]))
        return out
