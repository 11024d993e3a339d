"""ODBConfig: every knob of the engine in one validated dataclass.

The same dataclass is what the LLaMA-Factory adapter fills from `odb_*` YAML keys, so
every field documents the trade-off it controls.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

COST_MODES = ("padded", "packed")
OVER_BUDGET_POLICIES = ("singleton", "error")
LOSS_SCALINGS = ("exact", "none")
BALANCE_MODES = ("padded", "lpt", "min_move")


@dataclass
class ODBConfig:
    """Configuration of Online Dynamic Batching.

    token_budget: L_max, the per-rank token budget of one group (one micro-batch). A group's
        cost is `n * roundup(max_len, pad_to_multiple_of)` (cost_mode="padded", what a padding
        collator allocates) or `sum(len)` (cost_mode="packed", for padding-free models).
        Larger budgets mean fewer, fuller steps until memory or step time dominates.
    join: True (default) = strict identity coverage: every index of every rank's view is
        trained exactly once per epoch; ranks that run dry emit IDLE slots until all drain.
        False = sample-quota closure: ranks never run dry (their view cycles) and the epoch
        ends when exactly `quota` samples were trained, with no per-index guarantee.
    quota: samples per epoch in non-join mode (default: len(dataset)).
    loss_scaling: "exact" gives each step a `loss_scale` so that DDP's gradient average
        equals the gradient of the mean loss over all supervised tokens of all ranks
        (and of the gradient-accumulation window); "none" gives loss_scale = 1.
    gradient_accumulation_steps: micro-steps per optimizer step; the exact loss scale then
        normalises over the whole window.
    pad_epoch_to_accumulation: end every epoch with IDLE steps up to a multiple of
        gradient_accumulation_steps, for trainers that step the optimizer every N micro-steps.
    seed, shuffle: the per-(seed, epoch) permutation that defines each rank's view.
    buffer_size: B, samples a rank holds when it forms groups. Larger windows sort better
        (less padding) but delay the first step and hold more samples in memory.
    outstanding_depth: D, planned slots queued ahead of the trainer. It lets collation and
        the next window's alignment overlap training; too small a D makes the trainer wait
        at window boundaries (`data_wait_s` in the metrics shows it).
    pad_to_multiple_of: padding granularity used in the padded cost.
    max_vision_patches: optional cap on the summed vision patches of one group.
    over_budget: a sample whose own cost exceeds the budget: "singleton" trains it alone and
        counts it in the metrics (with a warning); "error" raises naming the sample.
    length_key, label_key, ignore_index: where the default cost function finds the tokens.
    label_shift: count supervised tokens as a shifted causal-LM loss sees them (labels[1:]).
    image_grid_key: key of the (num_images, 3) grid (t, h, w) in patches, if samples carry it.
    vision_token_ids, spatial_merge_size: if set, vision patches are counted as
        `#(tokens in vision_token_ids) * spatial_merge_size**2` when no grid is present.
    balance: post-balance every aligned step across ranks (OrchMLLM): the step's samples are
        re-dealt so each rank's LLM-stage cost is even, within `token_budget` per rank.
    balance_mode: "padded" (cost = n * g(max len), for padding collators), "lpt" (cost =
        sum, for packed/padding-free models) or "min_move" (few moves, within tolerance).
    balance_tolerance: min_move only, allowed excess of the slowest rank over the bound.
    ranks_per_node: node size for traffic accounting and placement (default: torchrun's
        LOCAL_WORLD_SIZE, else all ranks on one node).
    num_workers: DataLoader workers that run the dataset's per-sample pipeline.
    num_collate_workers: processes that collate groups in parallel (0: in the training thread).
    sync_timeout_s: timeout of every alignment collective; a timeout names rank and round.
    multiprocessing_context: "fork", "spawn", "forkserver" or None (torch's default).
    """

    token_budget: int = 4096
    join: bool = True
    quota: Optional[int] = None
    loss_scaling: str = "exact"
    gradient_accumulation_steps: int = 1
    pad_epoch_to_accumulation: bool = False
    seed: int = 0
    shuffle: bool = True
    buffer_size: int = 256
    outstanding_depth: int = 16
    pad_to_multiple_of: int = 1
    cost_mode: str = "padded"
    max_vision_patches: Optional[int] = None
    over_budget: str = "singleton"
    length_key: str = "input_ids"
    label_key: Optional[str] = "labels"
    ignore_index: int = -100
    label_shift: bool = True
    image_grid_key: str = "image_grid_thw"
    vision_token_ids: Sequence[int] = field(default_factory=tuple)
    spatial_merge_size: int = 2
    balance: bool = False
    balance_mode: str = "padded"
    balance_tolerance: float = 0.02
    ranks_per_node: Optional[int] = None
    num_workers: int = 0
    num_collate_workers: int = 0
    prefetch_factor: int = 2
    sync_timeout_s: float = 1800.0
    multiprocessing_context: Optional[str] = None

    def __post_init__(self) -> None:
        self.vision_token_ids = tuple(int(t) for t in self.vision_token_ids)
        self.validate()

    def validate(self) -> None:
        positive = ("token_budget", "gradient_accumulation_steps", "buffer_size",
                    "outstanding_depth", "pad_to_multiple_of", "spatial_merge_size",
                    "prefetch_factor")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ODBConfig.{name} must be a positive integer, got {value!r}")
        for name in ("num_workers", "num_collate_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"ODBConfig.{name} must be an integer >= 0, got {value!r}")
        if self.quota is not None and (not isinstance(self.quota, int) or self.quota <= 0):
            raise ValueError(f"ODBConfig.quota must be a positive integer or None, got {self.quota!r}")
        if self.max_vision_patches is not None and self.max_vision_patches <= 0:
            raise ValueError(
                f"ODBConfig.max_vision_patches must be positive or None, got {self.max_vision_patches!r}")
        if not self.sync_timeout_s > 0:
            raise ValueError(f"ODBConfig.sync_timeout_s must be > 0 seconds, got {self.sync_timeout_s!r}")
        _check_choice("cost_mode", self.cost_mode, COST_MODES)
        _check_choice("over_budget", self.over_budget, OVER_BUDGET_POLICIES)
        _check_choice("loss_scaling", self.loss_scaling, LOSS_SCALINGS)
        _check_choice("balance_mode", self.balance_mode, BALANCE_MODES)
        if self.ranks_per_node is not None and self.ranks_per_node <= 0:
            raise ValueError(f"ODBConfig.ranks_per_node must be positive or None, got {self.ranks_per_node!r}")
        _check_choice("multiprocessing_context", self.multiprocessing_context,
                      (None, "fork", "spawn", "forkserver"))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["vision_token_ids"] = list(self.vision_token_ids)
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ODBConfig":
        """Build from a mapping; an unknown key is an error naming the closest valid key."""
        known = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in known:
                raise ValueError(unknown_key_message(key, known, prefix=""))
        return cls(**dict(values))

    def planning_fields(self) -> dict:
        """The fields that must agree on every rank, or ranks would plan differently."""
        names = ("token_budget", "join", "quota", "loss_scaling", "gradient_accumulation_steps",
                 "seed", "shuffle", "buffer_size", "pad_to_multiple_of", "cost_mode",
                 "max_vision_patches", "over_budget", "label_shift", "balance", "balance_mode",
                 "balance_tolerance", "ranks_per_node")
        return {name: getattr(self, name) for name in names}


def unknown_key_message(key: str, known: Sequence[str], prefix: str) -> str:
    guess = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{guess[0]}'?" if guess else ""
    valid = ", ".join(prefix + k for k in sorted(known))
    return f"unknown ODB option '{prefix}{key}'{hint} Valid options: {valid}"


def _check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"ODBConfig.{name} must be one of {list(choices)}, got {value!r}")
