"""The two numerical solvers the benchmark shares: bisection (linear or geometric) and
non-negative least squares with scaled columns."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
from scipy.optimize import nnls


def bisect(below: Callable[[float], bool], lo: float, hi: float, steps: int,
           geometric: bool = False) -> float:
    """The point in [lo, hi] where `below(x)` turns from True to False (a fixed number of
    halvings; returns the last midpoint). `geometric` halves on a log scale, for ratios and
    other multiplicative quantities whose bracket spans orders of magnitude."""
    def midpoint(a: float, b: float) -> float:
        return math.sqrt(a * b) if geometric else 0.5 * (a + b)

    for _ in range(steps):
        mid = midpoint(lo, hi)
        if below(mid):
            lo = mid
        else:
            hi = mid
    return midpoint(lo, hi)


def scaled_nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`scipy.optimize.nnls` with every column scaled to unit norm first, so that columns of
    very different size (tokens ~1e3, tokens² ~1e7) are treated alike; the coefficients come
    back in the columns' own units."""
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(x / scale, y)
    return coef / scale
