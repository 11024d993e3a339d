"""Schedules + a step model -> simulated wall-clock train time and the report's metrics.

`features(schedule, profile)` and `evaluate(...)` (re-exported from
`odb_factory.simulation.pricing`, which `python -m odb_factory.dry_run` shares) reduce a schedule
to per-(micro-step, rank) numbers once and price them under any step model. This module adds
the ledger check, per-step times, the producer/consumer model of the outstanding depth D
(`data_wait`) and the explanations of the paper comparison.

Metric: emitted samples of all ranks / simulated wall-clock time. A schedule with any batch
over the memory cap is reported as OOM and gets no throughput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from odb_factory.simulation.pricing import (  # noqa: F401
    Features,
    Result,
    encoder_stage_seconds,
    evaluate,
    features,
)

from .methods import Schedule
from .solvers import bisect
from .workloads import Profile
from .step_model import StepModel


class LedgerError(AssertionError):
    """A schedule lost, duplicated or invented samples."""


def check_ledger(s: Schedule, n: int) -> None:
    """Join-style methods train every index exactly once; non-join trains exactly the quota."""
    idx = s.indices()
    if s.expected_samples is not None:
        if idx.shape[0] != s.expected_samples:
            raise LedgerError(f"{s.method}: {idx.shape[0]} samples trained, quota {s.expected_samples}")
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise LedgerError(f"{s.method}: index out of range")
        return
    counts = np.bincount(idx, minlength=n) if idx.size else np.zeros(n, dtype=np.int64)
    if counts.shape[0] != n or not np.all(counts == 1):
        missing = int(np.sum(counts[:n] == 0))
        dup = int(np.sum(counts[:n] > 1))
        raise LedgerError(f"{s.method}: {missing} samples never trained, {dup} trained more than once"
                          + (", indices out of range" if counts.shape[0] != n else ""))


def step_times(f: Features, m: StepModel) -> np.ndarray:
    """Seconds of every micro-step (slowest rank + collectives; optimizer on boundaries)."""
    busy = f.n > 0
    rank_s = (np.where(busy, m.llm_seconds(f.padded(), f.attention_sq()), m.idle_s)
              + m.vision_seconds(f.images, f.patches, f.patch_sq))
    t = rank_s.max(axis=1) + m.comm_micro_s
    if "step_ends" in f.extra:
        boundary = np.zeros(f.steps, dtype=bool)
        boundary[f.extra["step_ends"]] = True
    else:
        boundary = (np.arange(f.steps) + 1) % f.accumulation == 0
    boundary[-1:] = True
    return t + boundary * (m.comm_opt_s + m.optimizer_s)


# ----------------------------------------------------------------------------- data wait (D)
@dataclass
class DataWait:
    depth: int
    wait_s: float          # trainer idle, waiting for a planned step (incl. the first fill)
    train_s: float
    startup_s: float = 0.0  # the part of wait_s before the first step (paid by any loader)

    @property
    def wait_fraction(self) -> float:
        return self.wait_s / (self.wait_s + self.train_s) if self.train_s else 0.0

    @property
    def overlap(self) -> float:
        """Steady-state pipeline overlap: 1 - data wait after the first step / wall time."""
        steady = self.wait_s - self.startup_s
        return 1.0 - steady / (steady + self.train_s) if self.train_s else 1.0


def data_wait(step_s: Sequence[float], round_of_step: Sequence[int], new_samples: Sequence[int],
              depth: int, prep_s: float, workers: int = 4, prefetch_factor: int = 2,
              align_s: float = 0.005) -> DataWait:
    """Producer/consumer model of ODB's pipeline on one rank (all ranks are alike).

    Workers prepare samples at `workers / prep_s` per second and may run up to
    `prefetch_factor * workers` samples ahead of the planner. Round k needs `new_samples[k]`
    fresh samples (refilling the window), then one alignment (`align_s`), then its slots enter
    a queue of capacity `depth` (D) one by one; the trainer pops a slot whenever it is free.
    Larger D lets the planner run further ahead (more memory held in planned samples); the
    trainer waits when a window's fill time exceeds the training time queued ahead of it.
    """
    step_s = np.asarray(step_s, dtype=np.float64)
    rounds = np.asarray(round_of_step)
    rate = workers / prep_s if prep_s > 0 else math.inf
    ahead_cap = prefetch_factor * workers
    popped: List[float] = []           # time each slot left the queue (trainer start)
    free = 0.0                         # trainer free at
    wait = 0.0
    planner = 0.0                      # planner clock: when it may start the next round
    fetch_end = 0.0
    g = 0
    startup = None
    for k, need in enumerate(new_samples):
        idle = max(0.0, planner - fetch_end)
        ahead = min(ahead_cap, idle * rate) if k else 0.0
        fetch_end = planner + max(0.0, need - ahead) / rate + align_s
        ready = fetch_end
        while g < len(step_s) and rounds[g] == k:
            enter = max(ready, popped[g - depth] if g >= depth else 0.0)
            start = max(free, enter)
            wait += start - free
            if startup is None:
                startup = start - free
            popped.append(start)
            free = start + step_s[g]
            ready = enter
            g += 1
        planner = ready
    return DataWait(depth, wait, float(step_s.sum()), startup or 0.0)


def rounds_of(schedule: Schedule, buffer_size: int) -> tuple:
    """(round of each step, fresh samples each round needs on the slowest-filling rank) from an
    ODB schedule's SimulatedEpoch."""
    sim = schedule.extra["sim"]
    world = len(sim.slots)
    round_of = np.asarray([slot.round for slot in sim.slots[0]])
    n_rounds = int(round_of.max()) + 1 if round_of.size else 0
    emitted = np.zeros((n_rounds, world), dtype=np.int64)
    for r in range(world):
        for slot in sim.slots[r]:
            emitted[slot.round, r] += len(slot.samples)
    views = np.asarray([len(v) for v in sim.views])
    need = np.zeros(n_rounds, dtype=np.int64)
    pulled = np.zeros(world, dtype=np.int64)
    for k in range(n_rounds):
        want = np.full(world, buffer_size) if k == 0 else emitted[k - 1]
        got = np.minimum(want, views - pulled)
        pulled += got
        need[k] = int(got.max())
    return round_of, need


# ----------------------------------------------------------------------------- explanations
def speedup(f_base: Features, f_method: Features, p: Profile, m: StepModel) -> Optional[float]:
    base, other = evaluate(f_base, p, m), evaluate(f_method, p, m)
    if base.samples_per_s is None or other.samples_per_s is None:
        return None
    return other.samples_per_s / base.samples_per_s


def decompose(r: Result) -> Dict[str, float]:
    """time = useful compute x padding x c0/idle x straggler + fixed (per rank, seconds)."""
    return {"useful_s": r.useful_s,
            "padding_x": r.padded_s / r.useful_s if r.useful_s else 1.0,
            "c0_x": r.mean_rank_s / r.padded_s if r.padded_s else 1.0,
            "straggler_x": r.max_over_mean,
            "fixed_s": r.fixed_s, "fixed_share": r.fixed_s / r.time_s if r.time_s else 0.0,
            "time_s": r.time_s, "steps": r.optimizer_steps}


def explain(f_std: Features, f_odb: Features, p: Profile, m: StepModel, paper_speedup: float,
            paper_std_sps: Optional[float] = None) -> Dict[str, float]:
    """Numbers that say why our ODB speedup differs from the paper's:

    * both decompositions (padding, c0, straggler factors; fixed collective+optimizer share);
    * extra_fixed_s: seconds of extra per-optimizer-step overhead (on both methods) that
      would make our speedup equal the paper's (negative: the paper implies less overhead);
    * implied_mfu_ratio / speedup_at_implied: the compute efficiency at which our Standard
      matches the paper's absolute samples/s, and the speedup at that efficiency.
    """
    rs, ro = evaluate(f_std, p, m), evaluate(f_odb, p, m)
    ours = ro.samples_per_s / rs.samples_per_s
    out = {"ours": ours, "paper": paper_speedup, "ratio": ours / paper_speedup}
    out.update({f"std_{k}": v for k, v in decompose(rs).items()})
    out.update({f"odb_{k}": v for k, v in decompose(ro).items()})
    # Samples are equal (join) or equal to the quota, so speedup = T_std / T_odb * (So/Ss).
    k = ro.samples / rs.samples
    ns, no = rs.optimizer_steps, ro.optimizer_steps
    # paper = k * (Ts + x ns) / (To + x no)  ->  x = (paper To - k Ts) / (k ns - paper no)
    denom = k * ns - paper_speedup * no
    out["extra_fixed_s"] = ((paper_speedup * ro.time_s - k * rs.time_s) / denom) if denom else float("nan")
    if paper_std_sps:
        r = bisect(lambda x: evaluate(f_std, p, m.scaled(x)).samples_per_s < paper_std_sps,
                   0.05, 20.0, 60, geometric=True)
        out["implied_mfu_ratio"] = r
        out["speedup_at_implied"] = speedup(f_std, f_odb, p, m.scaled(r))
    return out
