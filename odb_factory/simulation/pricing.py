"""Schedules + a step model -> simulated wall-clock train time and the batching figures.

`features(schedule, samples)` reduces every (micro-step, rank) batch to the numbers the step
model needs once; `evaluate(...)` prices them under any step model (so one schedule serves
every setting that shares its world size). Used by the benchmark (`bench/simulate.py`) and by
`python -m odb_factory.dry_run`.

Metric: emitted samples of all ranks / simulated wall-clock time. A schedule with any batch
over the memory cap is reported as OOM and gets no throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np

from .schedules import Schedule
from .step_model import StepModel


class SampleArrays(Protocol):
    """Per-sample numbers a schedule is priced on (a benchmark `Profile`, or a plan's rows).
    Optional: `rows_per_sample` (default 1), the equal rows one sample is trained as (a dpo
    pair: 2, its chosen and rejected rows, each half its tokens)."""
    tokens: np.ndarray      # LLM input tokens (vision tokens included)
    images: np.ndarray      # images per sample
    patches: np.ndarray     # vision patches per sample (before the spatial merge)
    patch_sq: np.ndarray    # sum over the sample's images of patches**2


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
    # how a packed row attends (PACKED_ATTENTIONS): per sample, or one dense block-causal mask
    packed_attention: str = "segments"
    rows_per_sample: int = 1  # SampleArrays.rows_per_sample
    # positions whose logits each batch computes; None: every occupied position (`padded`)
    logit_tokens: Optional[np.ndarray] = None

    @property
    def steps(self) -> int:
        return int(self.n.shape[0])

    def padded(self) -> np.ndarray:
        """LLM tokens each batch occupies: n * max_len (padded) or sum len (packed)."""
        return self.sum_len if self.cost_mode == "packed" else self.n * self.max_len

    def attention_sq(self) -> np.ndarray:
        """Attention work in token² units, as the attention that runs computes it: a padded
        batch n · max_len²; a packed row Σ len² per sample (flash varlen, per-segment sdpa) or
        (Σ len)² (sdpa/eager over transformers' dense block-causal mask). A sample of k rows
        attends within each row: its len² counts len² / k."""
        if self.cost_mode != "packed":
            return self.n * self.max_len ** 2 / self.rows_per_sample
        return self.sum_len ** 2 if self.packed_attention == "mask" else self.sum_sq / self.rows_per_sample

    def logit_positions(self) -> np.ndarray:
        """Positions whose logits each batch computes: every occupied one (padding included),
        or with `supervised_logits` the supervised ones only."""
        return self.padded() if self.logit_tokens is None else self.logit_tokens


PACKED_ATTENTIONS = ("segments", "mask")


def features(s: Schedule, p: SampleArrays, packed_attention: str = "segments",
             supervised_logits: bool = False) -> Features:
    """`packed_attention`: how the run's packed rows attend ('segments': flash varlen or
    per-segment sdpa; 'mask': a dense block-causal mask), which prices their attention.
    `supervised_logits`: the run computes logits at its supervised positions only (ODB's
    `odb_supervised_logits`; `p` then needs `label_tokens`), not at every occupied position."""
    if packed_attention not in PACKED_ATTENTIONS:
        raise ValueError(f"packed_attention {packed_attention!r} is not one of {list(PACKED_ATTENTIONS)}")
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
                    {**s.extra, **({"step_ends": s.step_ends} if s.step_ends is not None else {})},
                    packed_attention, int(getattr(p, "rows_per_sample", 1)),
                    reduce(p.label_tokens, np.add) if supervised_logits else None)


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


def encoder_stage_seconds(f: Features, p: SampleArrays, m: StepModel) -> np.ndarray:
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


def sample_seconds(m: StepModel, p: SampleArrays, rows_per_sample: int) -> np.ndarray:
    """Each sample alone on a rank (`StepModel.sample_seconds`, its k rows attending apart)."""
    length = p.tokens.astype(np.float64)
    return (m.llm_seconds(length, length * length / rows_per_sample) + m.head * length
            + m.vision_seconds(p.images, p.patches, p.patch_sq))


def optimizer_step_starts(f: Features) -> np.ndarray:
    """The micro-step each optimizer step starts at."""
    if "step_ends" in f.extra:
        return np.concatenate([[0], np.asarray(f.extra["step_ends"][:-1], dtype=np.int64) + 1])
    return np.arange(0, f.steps, f.accumulation)


def evaluate(f: Features, p: SampleArrays, m: StepModel) -> Result:
    if f.world != m.world:
        raise ValueError(f"{f.method}: schedule for {f.world} ranks, step model for {m.world}")
    tokens, sq = f.padded(), f.attention_sq()
    busy = f.n > 0
    vision = m.vision_seconds(f.images, f.patches, f.patch_sq)
    llm = np.where(busy, m.llm_seconds(tokens, sq) + m.head * f.logit_positions(), m.idle_s)
    if f.extra.get("encoder_balanced"):
        # Two stages, each balanced and synchronised on its own: vision, then LLM.
        rank_s = llm + encoder_stage_seconds(f, p, m)[:, None]
    else:
        rank_s = llm + vision
    step_max = rank_s.max(axis=1) if f.steps else np.zeros(0)
    step_mean = rank_s.mean(axis=1) if f.steps else np.zeros(0)
    # Per-step lower bound: perfect spread of the step's work, or its costliest sample alone.
    solo = sample_seconds(m, p, f.rows_per_sample)
    cell_solo = np.zeros(f.steps * f.world)
    if f.flat.size:
        cell_solo[f.cell] = np.maximum.reduceat(solo[f.flat], f.starts)
    step_lb = np.maximum(step_mean, cell_solo.reshape(f.steps, f.world).max(axis=1)) if f.steps else step_mean
    micro = f.steps
    opt = len(f.extra["step_ends"]) if "step_ends" in f.extra else -(-micro // f.accumulation)
    fixed = micro * m.comm_micro_s + opt * (m.comm_opt_s + m.optimizer_s)
    waited = step_max.sum()
    if m.ranks_meet == "optimizer_step" and micro:
        waited = np.add.reduceat(rank_s, optimizer_step_starts(f), axis=0).max(axis=1).sum()
    time_s = float(waited + fixed)
    mem_ok = m.fits(tokens, f.patches)
    oom = int(np.sum(busy & ~mem_ok))
    samples = int(f.n.sum())
    real = float(f.sum_len.sum())
    padded = float(tokens[busy].sum())
    lengths = p.tokens[f.flat].astype(np.float64)
    useful = float((((m.a + m.head) * lengths + m.b * lengths * lengths / f.rows_per_sample).sum()
                    + m.vision_seconds(p.images[f.flat], p.patches[f.flat], p.patch_sq[f.flat]).sum())
                   / f.world)
    padded_s = float((m.a * tokens[busy].sum() + m.b * sq[busy].sum() + m.head * f.logit_positions()[busy].sum()
                      + vision.sum()) / f.world)
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
