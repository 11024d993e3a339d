"""Validation and flattening of per-rank inputs.

Every planner works on flat arrays indexed by a *sample id*; sample ids are assigned in
(source_rank, source_position) order, so sorting stably by any key breaks ties by
(source_rank, source_position) for free.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Samples:
    """All samples of one step, flattened in (source_rank, source_position) order."""

    num_ranks: int
    src: np.ndarray  # int64, source rank of each sample
    pos: np.ndarray  # int64, position on the source rank
    cost: np.ndarray  # float64 >= 0
    size: np.ndarray  # float64 >= 0, bytes to move the sample
    length: np.ndarray | None  # float64 >= 0, tokens (padded cost / token caps)

    @property
    def n(self) -> int:
        return int(self.src.shape[0])


def positive_int(value: object, name: str) -> int:
    """``value`` as an int >= 1 (ints, integral floats, numpy integers), else ValueError."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and float(value).is_integer() and value >= 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def positive_real(value: object, name: str) -> float:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _row(values: object, name: str, rank: int) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}[{rank}] must be a sequence of numbers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name}[{rank}] must be one-dimensional, got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        p = int(bad[0])
        raise ValueError(
            f"{name}[{rank}][{p}] = {float(arr[p])!r}: values must be finite and non-negative"
        )
    return arr + 0.0  # turns -0.0 into 0.0 so bit-level comparisons agree


def _per_rank(
    values: Sequence[Sequence[float]], name: str, counts: list[int] | None
) -> list[np.ndarray]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ValueError(f"{name} must be a list with one list of numbers per rank")
    rows = [_row(v, name, r) for r, v in enumerate(values)]
    if counts is not None:
        if len(rows) != len(counts):
            raise ValueError(
                f"{name} has {len(rows)} ranks but costs_per_rank has {len(counts)}"
            )
        for r, (row, c) in enumerate(zip(rows, counts)):
            if row.shape[0] != c:
                raise ValueError(
                    f"{name}[{r}] has {row.shape[0]} entries but costs_per_rank[{r}] has {c}"
                )
    return rows


def flatten(
    costs_per_rank: Sequence[Sequence[float]],
    sizes_per_rank: Sequence[Sequence[float]] | None = None,
    lengths_per_rank: Sequence[Sequence[float]] | None = None,
) -> Samples:
    """Validate the per-rank lists and flatten them. Sizes default to 1 per sample."""
    costs = _per_rank(costs_per_rank, "costs_per_rank", None)
    if not costs:
        raise ValueError("costs_per_rank must have at least one rank")
    counts = [int(c.shape[0]) for c in costs]
    m = len(costs)
    src = np.repeat(np.arange(m, dtype=np.int64), counts)
    pos = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    cost = np.concatenate(costs)
    if sizes_per_rank is None:
        size = np.ones_like(cost)
    else:
        size = np.concatenate(_per_rank(sizes_per_rank, "sizes_per_rank", counts))
    length = None
    if lengths_per_rank is not None:
        length = np.concatenate(_per_rank(lengths_per_rank, "lengths_per_rank", counts))
    return Samples(m, src, pos, cost, size, length)
