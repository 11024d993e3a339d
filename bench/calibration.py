"""The one number fitted to the paper: the matmul efficiency (MFU) of the step model."""

from __future__ import annotations

import math
from typing import Dict

from . import paper
from .lab import Lab, common_schedules, step_model_for
from .simulate import evaluate
from .solvers import bisect
from .step_model import DEFAULT_MFU
from .workloads import Profile

CALIBRATION_WORKLOADS = ("UltraChat-200K", "LLaVA-Instruct-150K")


def calibrate_mfu(lab: Lab, profiles: Dict[str, Profile]) -> float:
    """The matmul efficiency at which our Standard (8B, 1 node, full FT) matches the paper's
    Standard samples/s on UltraChat and LLaVA (geometric mean of the two ratios = 1).
    Everything else the report shows is a prediction at this efficiency."""
    targets = [f for f in paper.FIGURES if f.standard_sps and f.workload in
               CALIBRATION_WORKLOADS and f.workload in profiles]
    if not targets:
        return DEFAULT_MFU
    base = step_model_for("8B", "1n-full", DEFAULT_MFU)
    feats = []
    for f in targets:
        p = profiles[f.workload]
        common_schedules(lab, p, 8, only=("standard",))
        feats.append((lab.features(("standard", p.name, 8), p), p, f.standard_sps))

    def log_err(ratio: float) -> float:
        m = base.scaled(ratio)
        return sum(math.log(evaluate(fe, p, m).samples_per_s / target) for fe, p, target in feats)

    ratio = bisect(lambda r: log_err(r) < 0, 0.2, 5.0, 60, geometric=True)
    return min(1.0, DEFAULT_MFU * ratio)
