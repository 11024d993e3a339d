"""``balance()``: the pure, deterministic planning entry point, and its result."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .caps import Caps
from .inputs import Samples, flatten, positive_int
from .lpt import lpt_groups
from .min_move import min_move
from .padded import padded_cost, padded_groups
from .placement import PLACEMENTS, movement, place

MODES = ("lpt", "padded", "min_move")
DEFAULT_TOLERANCE = 0.05


@dataclass(frozen=True)
class BalancePlan:
    mode: str
    placement: str  # "none" for min_move, whose destinations already are ranks
    destinations: list[list[tuple[int, int]]]  # per rank: (source_rank, source_position)
    cost_before: list[float]
    cost_per_rank: list[float]
    lower_bound: float  # max(sum of unit costs / ranks, max unit cost)
    bytes_moved: float
    bytes_intra_node: float
    bytes_inter_node: float
    target: float | None = None  # min_move only: (1 + tolerance) * lower_bound
    target_met: bool | None = None

    @property
    def num_ranks(self) -> int:
        return len(self.destinations)

    @property
    def max_cost(self) -> float:
        return max(self.cost_per_rank)

    @property
    def max_over_lb(self) -> float:
        return self.max_cost / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def moves(self) -> list[tuple[int, int, int]]:
        """(source_rank, source_position, destination_rank) of every sample that moves."""
        return sorted((r, p, d) for d, dest in enumerate(self.destinations)
                      for r, p in dest if r != d)


def _unit_costs(s: Samples, mode: str, cost_model: Callable | None) -> np.ndarray:
    if mode != "padded":
        if cost_model is not None:
            raise ValueError("cost_model is only used by mode='padded'")
        return s.cost
    if s.length is None:
        if cost_model is not None:
            raise ValueError("cost_model needs lengths_per_rank")
        return s.cost  # costs are already g(length) per sample
    if cost_model is None:
        return s.length
    unit = np.asarray(cost_model(s.length), dtype=np.float64).reshape(-1) + 0.0
    if unit.shape != s.length.shape or not np.all(np.isfinite(unit) & (unit >= 0)):
        raise ValueError("cost_model must map lengths to finite non-negative costs, elementwise")
    order = np.argsort(s.length, kind="stable")
    if np.any(np.diff(unit[order]) < 0):
        raise ValueError("cost_model must be non-decreasing in length for mode='padded'")
    return unit


def _rank_costs(per_rank: list[np.ndarray], padded: bool) -> list[float]:
    if padded:
        return [padded_cost(u) for u in per_rank]
    return [math.fsum(u.tolist()) for u in per_rank]


def _assemble(s: Samples, unit: np.ndarray, dest: np.ndarray, padded: bool
              ) -> tuple[list[list[tuple[int, int]]], list[float], list[float]]:
    """Per-rank destination lists (sorted by source) and per-rank cost before and after."""
    m = s.num_ranks
    order = np.lexsort((s.pos, s.src, dest))
    cut = np.searchsorted(dest[order], np.arange(m + 1))
    destinations = [list(zip(s.src[order[a:b]].tolist(), s.pos[order[a:b]].tolist()))
                    for a, b in zip(cut[:-1], cut[1:])]
    after = [unit[order[a:b]] for a, b in zip(cut[:-1], cut[1:])]
    cut = np.searchsorted(s.src, np.arange(m + 1))  # samples come sorted by source already
    before = [unit[a:b] for a, b in zip(cut[:-1], cut[1:])]
    return destinations, _rank_costs(before, padded), _rank_costs(after, padded)


def balance(costs_per_rank: Sequence[Sequence[float]], ranks_per_node: int = 8,
            mode: str = "lpt", *, sizes_per_rank: Sequence[Sequence[float]] | None = None,
            lengths_per_rank: Sequence[Sequence[float]] | None = None,
            cost_model: Callable[[np.ndarray], np.ndarray] | None = None,
            max_samples_per_rank: int | None = None,
            token_budget: float | None = None,
            tolerance: float | None = None, placement: str | None = None,
            max_padded_tokens_per_rank: float | None = None) -> BalancePlan:
    """Plan which rank processes which sample so that per-rank costs are balanced.

    Pure and deterministic: every rank calling it with the same inputs gets the same plan.
    `token_budget`: no rank's padded tokens (samples × longest length) above it, as
    `odb_token_budget` / `ODBConfig.token_budget` caps a group (`max_padded_tokens_per_rank`
    is its deprecated name, until 0.3).
    """
    if max_padded_tokens_per_rank is not None:
        if token_budget is not None:
            raise TypeError("balance() got token_budget and its deprecated name max_padded_tokens_per_rank")
        warnings.warn("balance(max_padded_tokens_per_rank=...) is deprecated: use token_budget=...",
                      DeprecationWarning, stacklevel=2)
        token_budget = max_padded_tokens_per_rank
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    if placement is not None and placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; valid placements: "
                         f"{', '.join(PLACEMENTS)}")
    if mode == "min_move" and placement is not None:
        raise ValueError("placement does not apply to mode='min_move' (it moves samples "
                         "between ranks directly)")
    if tolerance is not None and mode != "min_move":
        raise ValueError("tolerance is only used by mode='min_move'")
    tol = DEFAULT_TOLERANCE if tolerance is None else tolerance
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) \
            or not (math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance!r}")
    rpn = positive_int(ranks_per_node, "ranks_per_node")
    s = flatten(costs_per_rank, sizes_per_rank, lengths_per_rank)
    caps = Caps.build(max_samples_per_rank, token_budget, s.length is not None)
    unit = _unit_costs(s, mode, cost_model)
    m = s.num_ranks
    lower_bound = max(math.fsum(unit.tolist()) / m, float(unit.max()) if s.n else 0.0)
    target = met = None
    if mode == "min_move":
        target = (1.0 + tol) * lower_bound
        dest, met = min_move(s, caps, rpn, target)
        method = "none"
    else:
        method = placement or "assignment"
        if mode == "lpt":
            groups = lpt_groups(s.cost, m, caps, s.length)
        else:
            groups = padded_groups(unit, m, caps, s.length)
        rank_of_group = place(groups, s.src, s.size, m, rpn, method)
        dest = np.empty(s.n, dtype=np.int64)
        for g, members in enumerate(groups):
            dest[members] = rank_of_group[g]
    destinations, cost_before, cost_after = _assemble(s, unit, dest, mode == "padded")
    moved, intra, inter = movement(dest, s.src, s.size, rpn)
    return BalancePlan(mode, method, destinations, cost_before, cost_after, lower_bound,
                       moved, intra, inter, target, met)
