"""Every uncertain input of the simulation layer, in one place: its nominal value, the range
the sensitivity analysis (bench.sensitivity) varies it over, and where it comes from.

`source` says "paper", "spec", "derived: ..." or "assumption"; `paper_in_view` is True where
the value was chosen or cross-checked with the papers' own throughput figures in view, so a
match with the paper on a row that depends on it is partly by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from odb_factory.simulation import step_model as sm


@dataclass(frozen=True)
class Assumption:
    name: str
    nominal: object
    low: object
    high: object
    unit: str
    source: str
    paper_in_view: bool = False
    varied: bool = True       # False: listed for the record, not varied by bench.sensitivity


# The pricing inputs bench.sensitivity varies (every combination of low / nominal / high).
MFU = Assumption(
    "matmul efficiency (MFU)", "calibrated", 0.55, 0.95, "fraction of peak BF16",
    "fitted: the one number calibrated so our Standard matches the paper's Standard samples/s "
    "(UltraChat, LLaVA, 8B); the range is an assumption (H20 big-GEMM efficiency)",
    paper_in_view=True)
OVERHEAD = Assumption(
    "fixed overhead per micro-step and per optimizer step", 1.0, 0.5, 2.0,
    "× nominal (c0 = kernel launches + 15 ms framework; 10 ms optimizer)",
    "assumption (kernel-launch and Python-hook costs; not in the papers)")
BANDWIDTH = Assumption(
    "collective bus bandwidth", 1.0, 0.5, 1.25, "× nominal (360 GB/s NVLink, 80 GB/s RoCE)",
    "spec × 0.8 achieved (assumption); the range covers NCCL efficiency and congestion")
# The profile inputs: each value regenerates the profiles (new schedules).
FAMILY = Assumption(
    "length-distribution family", "lognormal", "log-logistic", "log-gamma", "shape of the text-length draws",
    "assumption: the papers give each data set's mean and CV only; every family is solved to the same "
    "mean and CV after clipping (log-logistic: heavier right tail; log-gamma: lighter)")
MEAN_SCALE = Assumption(
    "mean length of the public workloads", 1.0, 0.85, 1.15, "× nominal mean (CV kept)",
    "see the three entries below")

PRICING = (MFU, OVERHEAD, BANDWIDTH)
PROFILE = (FAMILY, MEAN_SCALE)

# Inputs of the profiles, listed for the record (MEAN_SCALE varies the first three together).
PROFILE_MEANS = (
    Assumption("UltraChat-200K mean LLM tokens", 1350, None, None, "tokens",
               "derived: the UltraChat statistics table (≈1,467 tokens per dialogue) × ≈0.9 for "
               "Qwen's vocabulary (assumption) + ChatML overhead", varied=False),
    Assumption("LLaVA-Instruct-150K total mean", 540, None, None, "tokens",
               "assumption for the text part (≈240) + ≈300 image tokens (COCO sizes); cross-checked "
               "against the paper's ODB samples/s (tokens/s/GPU consistent with UltraChat's)",
               paper_in_view=True, varied=False),
    Assumption("ShareGPT-4o-57K total mean", 2000, None, None, "tokens",
               "assumption; cross-checked against the paper's absolute Standard samples/s",
               paper_in_view=True, varied=False),
    Assumption("MM-Mix, every statistic", "see bench/workloads.py", None, None, "",
               "assumption: the production mix is not public (synthetic profile)", varied=False),
)

CONSTANTS = (
    Assumption("per-kernel launch cost", sm.KERNEL_LAUNCH_S, None, None, "s", "assumption", varied=False),
    Assumption("framework time per micro-step", sm.FRAMEWORK_S, None, None, "s", "assumption", varied=False),
    Assumption("fixed optimizer time per step", sm.OPTIMIZER_FIXED_S, None, None, "s", "assumption",
               varied=False),
    Assumption("H20 peak dense BF16", 148e12, None, None, "FLOP/s", "spec", varied=False),
    Assumption("H20 HBM", 96, None, None, "GB", "spec", varied=False),
)

# Profiles that do not describe a published data set: labelled synthetic in every report table
# and left out of the count of paper matches.
SYNTHETIC_WORKLOADS = ("MM-Mix",)


def is_synthetic(workload: str) -> bool:
    return workload in SYNTHETIC_WORKLOADS


def markdown_table() -> str:
    rows = ["| input | nominal | range varied | source | chosen with the paper's figures in view |",
            "|---|---|---|---|---|"]
    for a in PRICING + PROFILE + PROFILE_MEANS + CONSTANTS:
        varied = f"{a.low} – {a.high} ({a.unit})" if a.varied else "—"
        nominal = f"{a.nominal:.4g} {a.unit}" if isinstance(a.nominal, float) and not a.varied else a.nominal
        rows.append(f"| {a.name} | {nominal} | {varied} | {a.source} | {'yes' if a.paper_in_view else 'no'} |")
    return "\n".join(rows)
