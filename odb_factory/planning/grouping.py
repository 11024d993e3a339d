"""Greedy token-budget grouping of one buffer window.

Samples are sorted longest first and cut into maximal contiguous runs whose cost fits the
budget. For the padded cost `n * roundup(max_len)` (and the packed cost, and a vision-patch
cap) a sub-run of a feasible run is feasible, so taking the longest feasible run at every
cut gives the fewest groups among all partitions into runs of the sorted order: no sample
is forced alone, and only the last (shortest) group can be partial.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, List, NamedTuple, Optional, Sequence

from ..config import OVER_BUDGET_POLICIES, option_name
from ..cost import SampleCost, padded_length


class PlannedSample(NamedTuple):
    """A sample as planning sees it (a tuple: built once per sample, at half a frozen
    dataclass's price)."""
    uid: Hashable          # unique within a rank's epoch (an index may recur in non-join mode)
    index: int             # dataset index, what ledgers record
    cost: SampleCost


@dataclass(frozen=True)
class Budget:
    token_budget: int
    cost_mode: str = "padded"          # "padded" | "packed"
    pad_to_multiple_of: int = 1
    max_vision_patches: Optional[int] = None
    max_audio_frames: Optional[int] = None

    @classmethod
    def from_config(cls, config) -> "Budget":
        return cls(config.token_budget, config.cost_mode, config.pad_to_multiple_of,
                   config.max_vision_patches, config.max_audio_frames)

    @property
    def has_encoder_caps(self) -> bool:
        return self.max_vision_patches is not None or self.max_audio_frames is not None

    def encoder_caps_hold(self, patches: int, frames: int) -> bool:
        return ((self.max_vision_patches is None or patches <= self.max_vision_patches)
                and (self.max_audio_frames is None or frames <= self.max_audio_frames))

    def describe_caps(self) -> str:
        return ((f" / vision cap {self.max_vision_patches}" if self.max_vision_patches else "")
                + (f" / audio cap {self.max_audio_frames} frames" if self.max_audio_frames else ""))

    def padded_length(self, tokens: int) -> int:
        return padded_length(tokens, self.pad_to_multiple_of)

    def group_cost(self, samples: Sequence[PlannedSample]) -> int:
        """Tokens the group occupies: padded `n * roundup(max)` or packed `sum`."""
        if not samples:
            return 0
        if self.cost_mode == "packed":
            return sum(s.cost.input_tokens for s in samples)
        return len(samples) * self.padded_length(max(s.cost.input_tokens for s in samples))

    def fits_alone(self, cost: SampleCost) -> bool:
        """fits([sample]) for a sample of `cost`, without building a group (form_groups asks it of
        every sample it plans)."""
        tokens = cost.input_tokens if self.cost_mode == "packed" else self.padded_length(cost.input_tokens)
        return tokens <= self.token_budget and self.encoder_caps_hold(cost.vision_patches, cost.audio_frames)

    def fits(self, samples: Sequence[PlannedSample]) -> bool:
        if self.group_cost(samples) > self.token_budget:
            return False
        return self.encoder_caps_hold(sum(s.cost.vision_patches for s in samples),
                                      sum(s.cost.audio_frames for s in samples))


class OverBudgetError(ValueError):
    """A single sample exceeds the budget and the policy is 'error'."""


@dataclass
class Grouping:
    groups: List[List[PlannedSample]]
    over_budget: List[PlannedSample] = field(default_factory=list)  # trained as singletons


def sort_key(sample: PlannedSample):
    # Longest first; ties broken by uid so every run of the planner is reproducible.
    return (-sample.cost.input_tokens, -sample.cost.vision_patches, sample.uid)


def form_groups(samples: Sequence[PlannedSample], budget: Budget,
                over_budget: str = "singleton") -> Grouping:
    """Partition `samples` into groups that each fit `budget` (see module docstring).

    A sample that does not fit even alone is put in a group of its own (policy
    "singleton", reported in `Grouping.over_budget`) or raises OverBudgetError naming it.
    """
    if over_budget not in OVER_BUDGET_POLICIES:
        raise ValueError(f"over_budget must be one of {OVER_BUDGET_POLICIES}, got {over_budget!r}")
    ordered = sorted(samples, key=sort_key)
    groups: List[List[PlannedSample]] = []
    oversized: List[PlannedSample] = []
    summed = budget.cost_mode == "packed"  # the packed cost is Σ len
    # the first sample that fits alone starts `current`: these starting values are never read
    current: List[PlannedSample] = []  # pragma: no mutate, never read
    # running cost of `current`; head: the padded length of its first (longest) sample
    head = packed = patches = frames = 0  # pragma: no mutate, never read
    for sample in ordered:
        tokens, _, vision, audio = sample.cost
        if not budget.fits_alone(sample.cost):
            if over_budget == "error":
                raise OverBudgetError(
                    f"sample {sample.index} costs {budget.group_cost([sample])} tokens"
                    f" ({tokens} LLM tokens, {vision} vision patches, {audio} audio frames) alone,"
                    f" over the token budget {budget.token_budget}" + budget.describe_caps()
                    + f"; raise {option_name('token_budget')}, lower cutoff_len/image pixels, or set "
                    f"{option_name('over_budget')} to 'singleton' (trains it alone)")
            oversized.append(sample)
            groups.append([sample])
            continue
        if current:
            # Appending a shorter sample never raises the group's max length, so this is
            # the whole feasibility test of the longer run.
            cost = packed + tokens if summed else (len(current) + 1) * head
            if cost <= budget.token_budget and budget.encoder_caps_hold(patches + vision, frames + audio):
                current.append(sample)
                packed += tokens
                patches += vision
                frames += audio
                continue
            groups.append(current)
        current, head, packed, patches, frames = [sample], budget.padded_length(tokens), tokens, vision, audio
    if current:
        groups.append(current)
    return Grouping(groups, oversized)
