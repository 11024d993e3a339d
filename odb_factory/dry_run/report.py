"""The dry run's figures, as pure functions of the measured rows and the run's settings.

Length statistics follow the benchmark's definitions (`odb_factory.token_lengths`): CV =
population std / mean of the LLM tokens, f_s = share of rows with at most 512 tokens, vision
share = vision tokens / all tokens. Batching figures come from the engine's own schedules
(`odb_factory.simulation.schedules`) over one epoch of the planned world.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

from ..balance.step_plan import step_balance_of
from ..config import ODBConfig
from ..cost import SampleCost
from ..planning.grouping import Budget, PlannedSample
from ..planning.optimizer_steps import fixed_batch_steps
from ..simulation.pricing import Features
from ..simulation.schedules import Schedule, costs_of, groups_schedule, index_array, samples_schedule
from ..token_lengths import SHORT_TOKENS, length_cv, short_fraction

FIRST = 10   # row numbers listed for each kind of row at fault


@dataclass
class Rows:
    """Per training row (dataset position): the numbers the plan is made of, as the run's cost
    function counts them (a dpo pair: the two rows of its longer side, padded)."""
    tokens: np.ndarray         # LLM input tokens after the pipeline (cut at cutoff_len)
    label_tokens: np.ndarray   # supervised tokens (as a shifted loss counts them; a pair: 1)
    images: np.ndarray         # images (runs of vision tokens)
    patches: np.ndarray        # vision patches before the spatial merge
    patch_sq: np.ndarray       # sum over the row's images of patches**2
    text_tokens: np.ndarray    # tokens less vision tokens
    full_tokens: np.ndarray    # tokens plus those cutoff_len cut off
    measured: np.ndarray       # True: the pipeline measured this row; False: numbers resampled
    rows_per_sample: int = 1   # rows a sample is trained as (a dpo pair: 2), for the pricing

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def rows_from(values: Dict[str, np.ndarray], positions: np.ndarray, total: int, merge: int,
              seed: int, rows_per_sample: int = 1) -> Rows:
    """All `total` rows: the measured ones as measured, every other row (not sampled, or one
    the pipeline failed on) with the numbers of a measured row drawn at random (seeded), so
    the plan covers the whole epoch at the data's measured length distribution."""
    if not len(positions):
        raise ValueError("the pipeline measured no row")
    source = np.empty(total, dtype=np.int64)
    measured = np.zeros(total, dtype=bool)
    measured[positions] = True
    source[positions] = np.arange(len(positions))
    rng = np.random.default_rng([int(seed), 17])
    missing = np.flatnonzero(~measured)
    source[missing] = rng.integers(0, len(positions), size=len(missing))
    take = {k: np.asarray(v, dtype=np.int64)[source] for k, v in values.items()}
    vision = take["patches"] // (merge * merge)
    return Rows(take["tokens"], take["label_tokens"], take["images"], take["patches"], take["patch_sq"],
                take["tokens"] - vision, take["full_tokens"], measured, rows_per_sample)


def length_stats(rows: Rows) -> dict:
    """Statistics of the measured rows."""
    m = rows.measured
    tokens = rows.tokens[m]
    return {"rows": int(m.sum()), "mean_tokens": float(tokens.mean()),
            "p50_tokens": float(np.percentile(tokens, 50)), "p99_tokens": float(np.percentile(tokens, 99)),
            "max_tokens": int(tokens.max()), "cv": length_cv(tokens),
            "short_fraction": short_fraction(tokens), "short_threshold": SHORT_TOKENS,
            "vision_share": float(1 - rows.text_tokens[m].sum() / tokens.sum()),
            "images_per_row": float(rows.images[m].mean()),
            "mean_label_tokens": float(rows.label_tokens[m].mean())}


def rows_at_fault(mask: np.ndarray, row_numbers: np.ndarray) -> dict:
    found = np.flatnonzero(mask)
    return {"count": int(len(found)), "first": [int(row_numbers[i]) for i in found[:FIRST]]}


def cut_rows(rows: Rows, row_numbers: np.ndarray) -> dict:
    """Measured rows cutoff_len shortened, and the tokens it cut off."""
    cut = rows.measured & (rows.full_tokens > rows.tokens)
    return {**rows_at_fault(cut, row_numbers),
            "tokens_cut": int((rows.full_tokens - rows.tokens)[cut].sum())}


def over_budget_rows(rows: Rows, budget: Budget, row_numbers: np.ndarray) -> dict:
    """Measured rows that do not fit the budget even alone (the engine's own test)."""
    alone = np.fromiter((not budget.fits([PlannedSample(i, i, SampleCost(int(t), 0, int(p)))])
                         for i, (t, p) in enumerate(zip(rows.tokens.tolist(), rows.patches.tolist()))),
                        dtype=bool, count=len(rows))
    return rows_at_fault(alone & rows.measured, row_numbers)


# ----------------------------------------------------------------------------- schedules
def standard_schedule(num_rows: int, world: int, batch: int, accumulation: int, seed: int) -> Schedule:
    """LLaMA-Factory's fixed batches: global batches of `batch x world` in a seeded order,
    batch j of a global batch to rank j, `accumulation` per optimizer step, the last global
    batch wrapped around to the epoch's first rows (the engine's `fixed_batch_steps`)."""
    per_rank = [fixed_batch_steps(num_rows, world, r, batch, accumulation, seed, epoch=0)
                for r in range(world)]
    steps = [[index_array(per_rank[r][s].micro_batches[m]) for r in range(world)]
             for s in range(len(per_rank[0])) for m in range(len(per_rank[0][s].micro_batches))]
    return Schedule("standard", world, steps, accumulation,
                    note=f"batch {batch} x accumulation {accumulation}")


def mode_schedules(rows: Rows, config: ODBConfig, world: int,
                   modes: Sequence[str] = ("samples", "groups")) -> Dict[str, Schedule]:
    """Standard and the ODB `modes` (`samples`, `groups`) for one epoch."""
    costs = costs_of(rows)
    standard = standard_schedule(len(rows), world, config.standard_batch_size,
                                 config.gradient_accumulation_steps, config.seed)
    return {"standard": standard, **{mode: schedule_for(mode, config, world, standard, costs)
                                     for mode in modes}}


def schedule_for(mode: str, config: ODBConfig, world: int, standard: Schedule,
                 costs: Sequence[SampleCost]) -> Schedule:
    """One ODB mode's schedule. Rows over the budget are planned as singletons whatever
    `odb_over_budget` says (the report names them)."""
    cfg = dataclasses.replace(config, over_budget="singleton")
    if mode == "samples":
        return samples_schedule(standard, costs, Budget.from_config(cfg), global_grouping=cfg.global_grouping,
                                ranks_per_node=cfg.ranks_per_node or world,
                                balance=step_balance_of(cfg, world) if cfg.balance else None)
    return groups_schedule(costs, cfg, world, name="odb_groups", pad_to_accumulation=True)


def occupied_tokens(f: Features, cost_mode: str, pad_multiple: int) -> np.ndarray:
    """Tokens each (micro-step, rank) batch occupies: `n x roundup(longest)` under a padding
    collator, the real tokens for padding-free batches."""
    if cost_mode == "packed":
        return f.sum_len
    return f.n * np.ceil(f.max_len / pad_multiple) * pad_multiple


def batching_figures(s: Schedule, f: Features, pad_multiple: int) -> dict:
    """Per-rank step counts and how full the micro-batches are, for one epoch.

    padded_waste: share of the occupied tokens that are padding. max_over_lb: per micro-step,
    the busiest rank's occupied tokens over the ranks' mean (the lower bound of the slowest
    rank if the step's work were spread evenly), summed over micro-steps before dividing."""
    occupied = occupied_tokens(f, s.cost_mode, pad_multiple)
    busy = f.n > 0
    filled = float(occupied[busy].sum())
    mean = occupied.mean(axis=1).sum()
    return {"optimizer_steps": int(s.optimizer_steps), "micro_batches": int(s.micro_steps),
            "samples": int(f.n.sum()),
            "samples_per_optimizer_step": float(f.n.sum() / max(1, s.optimizer_steps)),
            "padded_waste": 1.0 - float(f.sum_len.sum()) / filled if filled else 0.0,
            "max_over_lb": float(occupied.max(axis=1).sum() / mean) if mean else 1.0,
            "idle_slots": int((~busy).sum()),
            "largest_micro_batch_tokens": int(occupied.max()) if occupied.size else 0}


def failures(found: Sequence[tuple], row_numbers: np.ndarray) -> dict:
    """Rows the pipeline failed on (the run would stop at the first it reached)."""
    listed: List[dict] = [{"row": int(row_numbers[p]), "error": e} for p, e in found[:FIRST]]
    return {"count": len(found), "first": listed}


def sample_note(measured: int, total: int) -> str:
    if measured >= total:
        return f"all {total} training rows measured"
    return (f"{measured} of {total} training rows measured (a seeded random sample); the other rows "
            "take the numbers of measured rows drawn at random")

