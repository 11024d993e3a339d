"""Optional placement that minimises the busiest node's inter-node traffic (HiGHS MILP).

Node n's traffic is max(egress, ingress): bytes its ranks send to other nodes, and bytes they
receive from other nodes (links are full duplex, so each direction is its own bottleneck).
Traffic depends only on which *node* each group lands on, so the MILP has one binary per
(group, node), not per (group, rank). Objective, lexicographic:
  1. the maximum node traffic (MILP),
  2. total inter-node bytes, keeping 1 (second MILP),
  3. bytes moved, keeping the node choice (one assignment problem per node).
HiGHS runs with a node limit rather than a time limit so every rank gets the same answer;
if it stops early the result is still never worse than ``assignment`` on objective 1.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linear_sum_assignment, milp

from .placement import kept_bytes, nodes_of

NODE_LIMIT = 5000


def _from_node(a: np.ndarray, node: np.ndarray) -> np.ndarray:
    """``F[g, n]`` = bytes of group g whose source rank is on node n."""
    f = np.zeros((a.shape[0], int(node.max()) + 1))
    np.add.at(f.T, node, a.T)
    return f


def node_traffic(a: np.ndarray, perm: np.ndarray, ranks_per_node: int) -> float:
    """Max over nodes of max(egress, ingress) when group g goes to rank perm[g]."""
    node = nodes_of(a.shape[1], ranks_per_node)
    f = _from_node(a, node)
    on = np.zeros_like(f, dtype=bool)
    on[np.arange(f.shape[0]), node[perm]] = True
    egress = np.where(on, 0.0, f).sum(axis=0)
    ingress = np.where(on, f.sum(axis=1, keepdims=True) - f, 0.0).sum(axis=0)
    return float(max(egress.max(), ingress.max()))


def _inter_bytes(a: np.ndarray, perm: np.ndarray, node: np.ndarray) -> float:
    f = _from_node(a, node)
    return float(f.sum() - f[np.arange(f.shape[0]), node[perm]].sum())


def _solve_nodes(c: np.ndarray, cons: list[LinearConstraint], n_y: int) -> np.ndarray | None:
    integrality = np.r_[np.ones(n_y), 0.0]
    res = milp(c, constraints=cons, integrality=integrality,
               bounds=Bounds(0, np.r_[np.ones(n_y), np.inf]),
               options={"disp": False, "mip_rel_gap": 0.0, "node_limit": NODE_LIMIT})
    return None if res.x is None else res.x[:n_y]


def _ranks_within_nodes(a: np.ndarray, y: np.ndarray, node: np.ndarray) -> np.ndarray | None:
    g_node = np.argmax(y, axis=1)
    perm = np.empty(a.shape[0], dtype=np.int64)
    for n in range(y.shape[1]):
        groups, ranks = np.flatnonzero(g_node == n), np.flatnonzero(node == n)
        if groups.shape[0] != ranks.shape[0]:
            return None  # not a valid rounding of the MILP answer
        rows, cols = linear_sum_assignment(a[np.ix_(groups, ranks)], maximize=True)
        perm[groups[rows]] = ranks[cols]
    return perm


def milp_groups(a: np.ndarray, ranks_per_node: int, fallback: np.ndarray) -> np.ndarray:
    m = a.shape[1]
    node = nodes_of(m, ranks_per_node)
    n_nodes = int(node.max()) + 1
    if n_nodes == 1:  # no inter-node traffic at all: the assignment answer is optimal
        return fallback
    f = _from_node(a, node)
    n_y = m * n_nodes  # y[g, n] at index g * n_nodes + n
    eq = np.zeros((m + n_nodes, n_y + 1))
    for g in range(m):
        eq[g, g * n_nodes:(g + 1) * n_nodes] = 1  # each group on one node
    for n in range(n_nodes):
        eq[m + n, n:n_y:n_nodes] = 1  # node n takes as many groups as it has ranks
    sizes = np.bincount(node, minlength=n_nodes)
    one_each = LinearConstraint(eq, np.r_[np.ones(m), sizes], np.r_[np.ones(m), sizes])
    egress = np.zeros((n_nodes, n_y + 1))  # F[:, n].sum() - sum_g y[g, n] F[g, n] <= t
    ingress = np.zeros((n_nodes, n_y + 1))  # sum_g y[g, n] (S_g - F[g, n]) <= t
    for n in range(n_nodes):
        egress[n, n:n_y:n_nodes] = -f[:, n]
        ingress[n, n:n_y:n_nodes] = f.sum(axis=1) - f[:, n]
    egress[:, -1] = ingress[:, -1] = -1.0
    traffic = LinearConstraint(np.vstack([egress, ingress]), -np.inf,
                               np.r_[-f.sum(axis=0), np.zeros(n_nodes)])

    def key(perm: np.ndarray) -> tuple[float, float, float]:
        return (node_traffic(a, perm, ranks_per_node), _inter_bytes(a, perm, node),
                -kept_bytes(a, perm))

    best, best_key = fallback, key(fallback)
    y1 = _solve_nodes(np.r_[np.zeros(n_y), 1.0], [one_each, traffic], n_y)
    if y1 is not None:
        p1 = _ranks_within_nodes(a, y1.reshape(m, n_nodes), node)
        if p1 is not None and key(p1) < best_key:
            best, best_key = p1, key(p1)
    # Keep the best maximum found and minimise total inter-node bytes (= keep most on node).
    t_cap = LinearConstraint(np.r_[np.zeros(n_y), 1.0][None, :], -np.inf,
                             best_key[0] * (1 + 1e-12))
    y2 = _solve_nodes(np.r_[-f.ravel(), 0.0], [one_each, traffic, t_cap], n_y)
    if y2 is not None:
        p2 = _ranks_within_nodes(a, y2.reshape(m, n_nodes), node)
        if p2 is not None and key(p2) < best_key:
            best = p2
    return best
