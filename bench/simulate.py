"""Schedules + a step model -> simulated wall-clock train time and the report's metrics.

`features(schedule, profile)` reduces every (micro-step, rank) batch to the numbers the step
model needs once; `evaluate(...)` prices them under any step model (so one schedule serves
every setting that shares its world size). `data_wait(...)` is the producer/consumer model of
the outstanding depth D.

Metric: emitted samples of all ranks / simulated wall-clock time. A schedule with any batch
over the memory cap is reported as OOM and gets no throughput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

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


@dataclass
class Features:
    """Per (micro-step, rank) reductions of a schedule over a profile (arrays [steps, world])."""
    method: str
    world: int
    accumulation: int
    cost_mode: str
    n: np.ndarray
    max_len: np.ndarray
    sum_len: np.ndarray
    sum_sq: np.ndarray
    images: np.ndarray
    patches: np.ndarray
    patch_sq: np.ndarray
    flat: np.ndarray          # sample ids of every non-empty batch, concatenated
    starts: np.ndarray        # start of each non-empty batch in `flat`
    cell: np.ndarray          # flat position (step * world + rank) of each non-empty batch
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return int(self.n.shape[0])

    def padded(self) -> np.ndarray:
        """LLM tokens each batch occupies: n * max_len (padded) or sum len (packed)."""
        return self.sum_len if self.cost_mode == "packed" else self.n * self.max_len

    def attention_sq(self) -> np.ndarray:
        return self.sum_sq if self.cost_mode == "packed" else self.n * self.max_len ** 2


def features(s: Schedule, p: Profile) -> Features:
    steps, world = len(s.steps), s.world
    shape = (steps, world)
    lens = [len(b) for step in s.steps for b in step]
    n = np.asarray(lens, dtype=np.int64).reshape(shape) if steps else np.zeros(shape, dtype=np.int64)
    nonempty = np.flatnonzero(n.reshape(-1) > 0)
    parts = [b for step in s.steps for b in step if len(b)]
    flat = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    sizes = n.reshape(-1)[nonempty]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if sizes.size else sizes

    def reduce(values: np.ndarray, op) -> np.ndarray:
        out = np.zeros(steps * world, dtype=np.float64)
        if sizes.size:
            out[nonempty] = op.reduceat(values[flat].astype(np.float64), starts)
        return out.reshape(shape)

    t = p.tokens.astype(np.float64)
    return Features(s.method, world, s.accumulation, s.cost_mode, n.astype(np.float64),
                    reduce(t, np.maximum), reduce(t, np.add), reduce(t * t, np.add),
                    reduce(p.images, np.add), reduce(p.patches, np.add), reduce(p.patch_sq, np.add),
                    flat, starts, nonempty, s.note,
                    {**s.extra, **({"step_ends": s.step_ends} if s.step_ends is not None else {})})


@dataclass
class Result:
    method: str
    samples: int
    time_s: float
    samples_per_s: Optional[float]     # None when the schedule OOMs
    tokens_per_s: Optional[float]      # real (unpadded) LLM tokens
    padding_ratio: float               # padded-but-empty share of the LLM tokens computed
    micro_steps: int
    optimizer_steps: int
    max_over_lb: float                 # sum of step maxima / sum of per-step lower bounds
    max_over_mean: float               # sum of step maxima / sum of per-step rank means
    oom_batches: int
    peak_tokens: int
    idle_slots: int
    useful_s: float                    # real-token compute per rank if perfectly spread
    padded_s: float                    # the same on padded tokens
    mean_rank_s: float                 # sum over steps of the mean rank time (incl. c0)
    max_rank_s: float                  # sum over steps of the slowest rank time
    fixed_s: float                     # collectives + optimizer
    note: str = ""

    @property
    def oom(self) -> bool:
        return self.oom_batches > 0

    def row(self) -> dict:
        d = dict(self.__dict__)
        d["oom"] = self.oom
        return d


def encoder_stage_seconds(f: Features, p: Profile, m: StepModel) -> np.ndarray:
    """Per step: the vision stage when its images are re-balanced across ranks on their own
    (OrchMLLM-style encoder-stage balance): LPT of the step's per-image costs onto the ranks."""
    import heapq

    per_image = np.where(p.images > 0, p.patches / np.maximum(p.images, 1), 0.0)
    cost = m.vision_seconds(1, per_image, per_image ** 2)
    out = np.zeros(f.steps)
    step_of = f.cell // f.world
    ends = np.append(f.starts[1:], f.flat.shape[0])
    bounds = np.searchsorted(step_of, np.arange(f.steps + 1))
    for s in range(f.steps):
        a, b = bounds[s], bounds[s + 1]
        if a == b:
            continue
        ids = f.flat[f.starts[a]:ends[b - 1]]
        jobs = np.repeat(cost[ids], p.images[ids])
        if not jobs.size:
            continue
        loads = [0.0] * f.world
        for c in np.sort(jobs)[::-1].tolist():
            heapq.heapreplace(loads, loads[0] + c)
        out[s] = max(loads)
    return out


def evaluate(f: Features, p: Profile, m: StepModel) -> Result:
    if f.world != m.world:
        raise ValueError(f"{f.method}: schedule for {f.world} ranks, step model for {m.world}")
    tokens, sq = f.padded(), f.attention_sq()
    busy = f.n > 0
    vision = m.vision_seconds(f.images, f.patches, f.patch_sq)
    if f.extra.get("encoder_balanced"):
        # Two stages, each balanced and synchronised on its own: vision, then LLM.
        llm = np.where(busy, m.llm_seconds(tokens, sq), m.idle_s)
        stage = encoder_stage_seconds(f, p, m)
        rank_s = llm + stage[:, None]
    else:
        rank_s = np.where(busy, m.llm_seconds(tokens, sq), m.idle_s) + vision
    step_max = rank_s.max(axis=1) if f.steps else np.zeros(0)
    step_mean = rank_s.mean(axis=1) if f.steps else np.zeros(0)
    # Per-step lower bound: perfect spread of the step's work, or its costliest sample alone.
    solo = m.sample_seconds(p.tokens, p.patches, p.patch_sq, p.images)
    cell_solo = np.zeros(f.steps * f.world)
    if f.flat.size:
        cell_solo[f.cell] = np.maximum.reduceat(solo[f.flat], f.starts)
    step_lb = np.maximum(step_mean, cell_solo.reshape(f.steps, f.world).max(axis=1)) if f.steps else step_mean
    micro = f.steps
    opt = len(f.extra["step_ends"]) if "step_ends" in f.extra else -(-micro // f.accumulation)
    fixed = micro * m.comm_micro_s + opt * (m.comm_opt_s + m.optimizer_s)
    time_s = float(step_max.sum() + fixed)
    mem_ok = m.fits(tokens, f.patches)
    oom = int(np.sum(busy & ~mem_ok))
    samples = int(f.n.sum())
    real = float(f.sum_len.sum())
    padded = float(tokens[busy].sum())
    useful = float((m.token_cost(p.tokens[f.flat]).sum()
                    + m.vision_seconds(p.images[f.flat], p.patches[f.flat], p.patch_sq[f.flat]).sum())
                   / f.world)
    padded_s = float((m.a * tokens[busy].sum() + m.b * sq[busy].sum() + vision.sum()) / f.world)
    return Result(
        method=f.method, samples=samples, time_s=time_s,
        samples_per_s=None if oom else samples / time_s,
        tokens_per_s=None if oom else real / time_s,
        padding_ratio=0.0 if padded == 0 else 1.0 - real / padded,
        micro_steps=micro, optimizer_steps=opt,
        max_over_lb=float(step_max.sum() / step_lb.sum()) if micro else 1.0,
        max_over_mean=float(step_max.sum() / step_mean.sum()) if micro else 1.0,
        oom_batches=oom, peak_tokens=int(tokens.max()) if tokens.size else 0,
        idle_slots=int(np.sum(~busy)), useful_s=useful, padded_s=padded_s,
        mean_rank_s=float(step_mean.sum()), max_rank_s=float(step_max.sum()), fixed_s=float(fixed),
        note=f.note)


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
