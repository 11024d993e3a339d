"""Per-rank capacity caps shared by every planner.

Both caps have the form ``count <= K(longest length on the rank)`` with ``K`` non-increasing,
which is what makes the exact feasibility check below (longest-first greedy) exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .inputs import positive_int, positive_real


@dataclass(frozen=True)
class Caps:
    max_samples: int | None = None
    token_budget: float | None = None

    @staticmethod
    def build(max_samples: int | None, token_budget: float | None,
              have_lengths: bool) -> "Caps":
        if max_samples is not None:
            max_samples = positive_int(max_samples, "max_samples_per_rank")
        if token_budget is not None:
            token_budget = positive_real(token_budget, "token_budget")
            if not have_lengths:
                raise ValueError("token_budget needs lengths_per_rank")
        return Caps(max_samples, token_budget)

    @property
    def active(self) -> bool:
        return self.max_samples is not None or self.token_budget is not None

    def describe(self) -> str:
        parts = []
        if self.max_samples is not None:
            parts.append(f"max_samples_per_rank={self.max_samples}")
        if self.token_budget is not None:
            parts.append(f"token_budget={self.token_budget:g}")
        return " and ".join(parts) or "no caps"

    def accepts(self, count: int, max_len: float, length: float) -> bool:
        """Can a rank holding ``count`` samples (longest ``max_len``) take one more?"""
        if self.max_samples is not None and count + 1 > self.max_samples:
            return False
        if self.token_budget is not None:
            return (count + 1) * max(max_len, length) <= self.token_budget
        return True

    def accepts_many(self, counts: np.ndarray, max_lens: np.ndarray,
                     lengths: np.ndarray | None) -> np.ndarray:
        """Vectorised ``accepts``: boolean matrix [sample, rank]."""
        n = 1 if lengths is None else lengths.shape[0]
        ok = np.ones((n, counts.shape[0]), dtype=bool)
        if self.max_samples is not None:
            ok &= (counts + 1 <= self.max_samples)[None, :]
        if self.token_budget is not None and lengths is not None:
            padded = (counts + 1)[None, :] * np.maximum(max_lens[None, :], lengths[:, None])
            ok &= padded <= self.token_budget
        return ok

    def max_count(self, longest: float, remaining: int) -> int:
        """Most samples one rank may hold when its longest sample has length ``longest``."""
        k = remaining
        if self.max_samples is not None:
            k = min(k, self.max_samples)
        if self.token_budget is not None and longest > 0:
            return largest_multiple(longest, self.token_budget, k)
        return k


def largest_multiple(unit: float, limit: float, k_max: int) -> int:
    """Largest k in [0, k_max] with ``k * unit <= limit`` as computed in float64.

    Uses the product itself (not a rounded quotient) so every caller agrees exactly.
    """
    if unit <= 0:
        return k_max
    q = limit / unit
    k = k_max if q >= k_max else max(int(q), 0)
    while k > 0 and k * unit > limit:
        k -= 1
    while k < k_max and (k + 1) * unit <= limit:
        k += 1
    return k


def fits_on(caps: Caps, lengths_desc: np.ndarray | None, n: int, num_ranks: int) -> bool:
    """Exact: can ``n`` samples (lengths sorted descending) be placed on ``num_ranks`` ranks?

    Longest-first greedy: the rank holding the longest remaining sample may as well take as
    many of the next longest as the caps allow (swapping shorter for longer never hurts).
    """
    p, used = 0, 0
    while p < n:
        # no lengths: Caps.build allows no token cap, so `longest` is not read
        longest = 0.0 if lengths_desc is None else float(lengths_desc[p])  # pragma: no mutate
        k = caps.max_count(longest, n - p)  # pragma: no mutate, any bound >= n - p ends the loop alike
        if k == 0 or used == num_ranks:
            return False
        p, used = p + k, used + 1
    return True


def infeasible_error(caps: Caps, n: int, num_ranks: int) -> ValueError:
    return ValueError(
        f"infeasible caps: {n} samples cannot be placed on {num_ranks} ranks with "
        f"{caps.describe()}"
    )
