"""`step_mode="samples"`: keep the fixed-batch (Standard) run's optimizer steps, pack each.

Standard trains, per optimizer step and rank, `accumulation` micro-batches of
`batch_size` samples. In samples mode every optimizer step trains exactly those samples:
each rank packs its share of the step into as few token-budgeted micro-batches as the
budget allows, the ranks align their micro-batch counts (splitting, else IDLE slots), and
every sample carries the weight its label tokens have in Standard's loss, so the step's
gradient is Standard's whatever the packing. Pure functions; the planner thread runs them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from .alignment import fit_to_target
from .grouping import Budget, PlannedSample, form_groups

MICRO_MEAN = "micro_mean"   # each micro-batch's token mean, averaged (LLaMA-Factory VLMs)
TOKEN_MEAN = "exact"        # the global token mean of the step over all ranks


@dataclass(frozen=True)
class StandardStep:
    """One optimizer step of the Standard run on one rank: its micro-batches of indices."""
    micro_batches: Tuple[Tuple[int, ...], ...]

    @property
    def indices(self) -> List[int]:
        return [i for batch in self.micro_batches for i in batch]


def fixed_batch_steps(num_samples: int, world_size: int, rank: int, batch_size: int,
                      accumulation: int, seed: int, epoch: int, shuffle: bool = True) -> List[StandardStep]:
    """The optimizer steps of a plain fixed-batch run, for users without a trainer of their
    own: a seeded permutation cut into global batches of `batch_size × world_size`, batch j
    dealt to rank j mod world, `accumulation` consecutive batches per optimizer step (the
    last global batch wraps around to the epoch's first samples, the last step may hold
    fewer micro-batches, as torch/accelerate's sharded samplers do)."""
    order = list(range(num_samples))
    if shuffle:
        random.Random(f"odb-steps:{seed}:{epoch}").shuffle(order)
    per_global = batch_size * world_size
    globals_ = -(-num_samples // per_global)
    padded = [order[i % num_samples] for i in range(globals_ * per_global)]
    mine = [tuple(padded[g * per_global + rank * batch_size: g * per_global + (rank + 1) * batch_size])
            for g in range(globals_)]
    return [StandardStep(tuple(mine[s:s + accumulation])) for s in range(0, len(mine), accumulation)]


def sample_weights(step: StandardStep, label_tokens: Sequence[int], normalization: str,
                   world_size: int, global_label_tokens: int) -> List[float]:
    """Weight of each sample of `step` (in `step.indices` order): multiply the sum of its
    token losses by it; summing over this rank gives a loss whose DDP average over ranks is
    Standard's loss.

    micro_mean: Standard averages each micro-batch's token mean over its `n` micro-batches
        and DDP averages ranks, so a sample of micro-batch m weighs 1 / (T_m · n).
    exact: the global token mean; DDP's average over W ranks is undone by W / T_global.
    """
    if normalization == TOKEN_MEAN:
        weight = world_size / global_label_tokens if global_label_tokens else 0.0
        return [weight] * len(label_tokens)
    if normalization != MICRO_MEAN:
        raise ValueError(f"unknown Standard loss normalization {normalization!r}")
    weights, position, n = [], 0, len(step.micro_batches)
    for batch in step.micro_batches:
        tokens = sum(label_tokens[position:position + len(batch)])
        weights += [1.0 / (tokens * n) if tokens else 0.0] * len(batch)
        position += len(batch)
    return weights


def pack_step(samples: Sequence[PlannedSample], budget: Budget, over_budget: str) -> List[List[PlannedSample]]:
    """This rank's share of a step in as few budget-feasible micro-batches as grouping finds."""
    return form_groups(samples, budget, over_budget).groups


def align_step(groups: Sequence[Sequence[PlannedSample]], counts: Sequence[int],
               budget: Budget) -> List[List[PlannedSample]]:
    """Exactly max(counts) micro-batches (every rank runs the same number): more by
    splitting the largest groups, then IDLE slots ([]). Never merges, so never over budget."""
    target = max(counts)
    fit = fit_to_target(groups, target, budget)
    if fit.recirculated:
        raise AssertionError("a rank holds more groups than the step's target")
    return fit.slots


def weights_by_uid(samples: Sequence[PlannedSample], weights: Sequence[float]) -> Dict[object, float]:
    return {s.uid: w for s, w in zip(samples, weights)}
