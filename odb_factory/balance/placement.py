"""Map groups (bins without rank identity) onto ranks, and count the bytes that move.

Objective of ``assignment`` (lexicographic): first keep the most bytes on their source rank
(= move the fewest bytes), then keep the most of the remaining bytes on their source node
(= send the fewest bytes across nodes). Both are sums over (group, rank) pairs, so this is a
linear assignment problem solved exactly by ``scipy.optimize.linear_sum_assignment``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import linear_sum_assignment

PLACEMENTS = ("assignment", "naive", "milp")


def nodes_of(num_ranks: int, ranks_per_node: int) -> np.ndarray:
    return np.arange(num_ranks) // ranks_per_node


def group_bytes(groups: list[list[int]], src: np.ndarray, size: np.ndarray,
                num_ranks: int) -> np.ndarray:
    """``A[g, r]`` = bytes in group g whose source is rank r."""
    a = np.zeros((len(groups), num_ranks))
    for g, members in enumerate(groups):
        if members:
            idx = np.asarray(members, dtype=np.int64)
            np.add.at(a[g], src[idx], size[idx])
    return a


def same_node_bytes(a: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """``B[g, r]`` = bytes in group g whose source is on rank r's node (includes A[g, r])."""
    node = nodes_of(a.shape[1], ranks_per_node)
    per_node = np.zeros((a.shape[0], int(node.max()) + 1))
    np.add.at(per_node.T, node, a.T)
    return per_node[:, node]


def kept_bytes(m: np.ndarray, perm: np.ndarray) -> float:
    return math.fsum(m[np.arange(m.shape[0]), perm].tolist())


def optimal_edges(a: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Mask of (g, r) pairs used by *some* assignment maximising the sum of ``a``.

    ``perm`` is one optimal assignment. Column potentials are shortest-path distances in its
    exchange graph (moving group g from rank perm[g] to r gains a[g, r] - a[g, perm[g]]; no
    improving cycle exists because perm is optimal). They give optimal LP duals, and by
    complementary slackness the optimal assignments are exactly the perfect matchings of the
    zero-reduced-cost pairs. With integer byte counts all of this is exact integer arithmetic.
    """
    m = a.shape[0]  # pragma: no mutate, a is square here (one group per rank)
    own = a[np.arange(m), perm]
    step = np.empty_like(a)
    step[perm, :] = own[:, None] - a  # loss of moving the group on rank x to rank r
    v = np.zeros(m)
    for _ in range(m):  # Bellman-Ford, vectorised over edges
        nv = np.minimum(v, (v[:, None] + step).min(axis=0))
        if np.array_equal(nv, v):  # pragma: no mutate, an early exit: converged values stay
            break
        v = nv
    reduced = own[:, None] - a + v[perm][:, None] - v[None, :]  # >= 0, 0 on perm
    scale = float(np.abs(a).max(initial=0.0)) * m
    integral = bool(np.all(a == np.round(a))) and scale < 2.0**52
    return reduced <= (0.5 if integral else 1e-12 * (scale + 1.0))


def assign_groups(a: np.ndarray, ranks_per_node: int) -> np.ndarray:
    """Rank of each group, lexicographically optimal for (bytes kept on rank, on node)."""
    _, first = linear_sum_assignment(a, maximize=True)
    tight = optimal_edges(a, first)
    if tight.sum() == a.shape[0]:
        return first  # the optimum on key 1 is unique
    b = same_node_bytes(a, ranks_per_node)
    _, both = linear_sum_assignment(np.where(tight, b, -np.inf), maximize=True)
    # Guard for fractional sizes, where "tight" is up to rounding: never give up key 1.
    return both if kept_bytes(a, both) >= kept_bytes(a, first) else first


def place(groups: list[list[int]], src: np.ndarray, size: np.ndarray, num_ranks: int,
          ranks_per_node: int, method: str) -> np.ndarray:
    """Rank of each group (a permutation of range(num_ranks))."""
    if method == "naive":
        return np.arange(num_ranks)
    a = group_bytes(groups, src, size, num_ranks)
    if method == "assignment":
        return assign_groups(a, ranks_per_node)
    if method == "milp":
        from .milp_placement import milp_groups  # scipy.optimize.milp only when asked for

        return milp_groups(a, ranks_per_node, assign_groups(a, ranks_per_node))
    raise ValueError(f"unknown placement {method!r}; valid placements: {', '.join(PLACEMENTS)}")


def movement(dest: np.ndarray, src: np.ndarray, size: np.ndarray,
             ranks_per_node: int) -> tuple[float, float, float]:
    """(bytes moved, intra-node bytes, inter-node bytes); a sample that stays moves 0 bytes."""
    moved = dest != src
    inter = moved & (dest // ranks_per_node != src // ranks_per_node)
    intra = moved & ~inter
    b_intra = math.fsum(size[intra].tolist())
    b_inter = math.fsum(size[inter].tolist())
    return b_intra + b_inter, b_intra, b_inter
