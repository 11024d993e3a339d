"""Placement of groups onto ranks (assignment / naive / milp) and byte accounting."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odb_factory.balance import balance, lpt_groups
from odb_factory.balance.inputs import flatten
from odb_factory.balance.milp_placement import node_traffic
from odb_factory.balance.placement import (assign_groups, group_bytes, kept_bytes, movement,
                                           place, same_node_bytes)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def instance(draw, max_ranks=16, max_samples=96):
    """Four bytes per sample: source rank, cost (log-uniform 2**-6..2**14 or 0), size, spare."""
    m = draw(st.integers(1, max_ranks))
    raw = draw(st.binary(max_size=4 * max_samples))
    costs, sizes = [[] for _ in range(m)], [[] for _ in range(m)]
    for j in range(0, len(raw) - 3, 4):
        r, c, b0, b1 = raw[j:j + 4]
        costs[r % m].append(0.0 if c == 0 else 2.0 ** (c / 12.75 - 6))
        sizes[r % m].append(b0 * 256 + b1)
    return costs, sizes


def groups_and_bytes(costs, sizes):
    s = flatten(costs, sizes)
    groups = lpt_groups(s.cost, s.num_ranks)
    return s, groups, group_bytes(groups, s.src, s.size, s.num_ranks)


def accounting(s, groups, perm, rpn):
    dest = np.empty(s.n, dtype=np.int64)
    for g, members in enumerate(groups):
        dest[members] = perm[g]
    return movement(dest, s.src, s.size, rpn)


@settings(max_examples=500, **SETTINGS)
@given(instance(), st.sampled_from([1, 2, 4, 8]), st.sampled_from(["lpt", "padded"]))
def test_assignment_never_moves_more_than_naive(inst, rpn, mode):
    costs, sizes = inst
    kw = dict(sizes_per_rank=sizes)
    best = balance(costs, rpn, mode, placement="assignment", **kw)
    naive = balance(costs, rpn, mode, placement="naive", **kw)
    assert sorted(best.cost_per_rank) == sorted(naive.cost_per_rank)  # same groups, relabelled
    assert best.bytes_moved <= naive.bytes_moved
    if best.bytes_moved == naive.bytes_moved:
        assert best.bytes_inter_node <= naive.bytes_inter_node


@settings(max_examples=150, **SETTINGS)
@given(instance(max_ranks=6, max_samples=30), st.sampled_from([1, 2, 3]))
def test_assignment_is_lexicographically_optimal(inst, rpn):
    s, groups, _ = groups_and_bytes(*inst)
    m = s.num_ranks
    got = accounting(s, groups, place(groups, s.src, s.size, m, rpn, "assignment"), rpn)
    best = min((acc[0], acc[2]) for acc in (accounting(s, groups, np.array(p), rpn)
                                             for p in itertools.permutations(range(m))))
    assert (got[0], got[2]) == best  # fewest bytes moved, then fewest across nodes


@settings(max_examples=300, **SETTINGS)
@given(st.integers(2, 5).flatmap(lambda m: st.lists(
    st.lists(st.sampled_from([0, 1, 2, 10**9, 10**9 + 1]), min_size=m, max_size=m),
    min_size=m, max_size=m)), st.sampled_from([1, 2, 3]))
def test_assignment_keys_are_exact_at_gigabyte_scale(rows, rpn):
    # Ties on bytes moved at GB scale that differ by single bytes on the node key: a weighted
    # float sum of both keys gets ~4% of these wrong; the dual-based restriction must not.
    a = np.array(rows, dtype=float)
    b = same_node_bytes(a, rpn)
    def keys(perm):
        return kept_bytes(a, perm), kept_bytes(b, perm)
    best = max(keys(np.array(p)) for p in itertools.permutations(range(len(rows))))
    assert keys(assign_groups(a, rpn)) == best


@settings(max_examples=30, **SETTINGS)
@given(instance(max_ranks=6, max_samples=30), st.sampled_from([1, 2, 3]))
def test_milp_minimises_busiest_node_traffic(inst, rpn):
    s, groups, a = groups_and_bytes(*inst)
    m = s.num_ranks
    perm = place(groups, s.src, s.size, m, rpn, "milp")
    assert sorted(perm.tolist()) == list(range(m))
    best = min(node_traffic(a, np.array(p), rpn) for p in itertools.permutations(range(m)))
    assert node_traffic(a, perm, rpn) == best
    assignment = place(groups, s.src, s.size, m, rpn, "assignment")
    assert node_traffic(a, perm, rpn) <= node_traffic(a, assignment, rpn)
    costs, sizes = inst
    plan = balance(costs, rpn, placement="milp", sizes_per_rank=sizes)
    assert plan_traffic(plan, sizes, rpn) == best  # independent count from the plan's moves


def plan_traffic(plan, sizes, rpn):
    """Busiest node's max(egress, ingress), straight from the plan's moves."""
    n_nodes = (plan.num_ranks + rpn - 1) // rpn
    egress, ingress = [0] * n_nodes, [0] * n_nodes
    for r, p, d in plan.moves:
        if r // rpn != d // rpn:
            egress[r // rpn] += sizes[r][p]
            ingress[d // rpn] += sizes[r][p]
    return max(egress + ingress)


def test_milp_beats_assignment_on_node_traffic_at_16_ranks():
    rng = np.random.default_rng(7)
    costs = [rng.lognormal(0, 1.5, 6).tolist() for _ in range(16)]
    sizes = [rng.integers(1, 1000, 6).tolist() for _ in range(16)]
    plans = {p: balance(costs, 4, placement=p, sizes_per_rank=sizes)
             for p in ("naive", "assignment", "milp")}
    traffic = {name: plan_traffic(plan, sizes, 4) for name, plan in plans.items()}
    assert traffic["milp"] <= min(traffic["assignment"], traffic["naive"])
    assert traffic["milp"] < traffic["assignment"]  # holds for this seed; the point of milp
    assert plans["assignment"].bytes_moved <= plans["milp"].bytes_moved
    assert plans["milp"] == balance(costs, 4, placement="milp", sizes_per_rank=sizes)


def test_ties_in_bytes_moved_are_broken_by_staying_on_the_node():
    # Groups 2 and 3 both hold 5 bytes from rank 0: one stays there, the other must move, and
    # rank 1 (node 0) is better than ranks 2 or 3 (node 1). Rank 0 alone would not see that.
    a = np.array([[0, 0, 0, 0], [0, 0, 0, 0], [5, 0, 0, 0], [5, 0, 0, 0]], dtype=float)
    perm = assign_groups(a, ranks_per_node=2)
    assert sorted(perm[2:].tolist()) == [0, 1]


def test_one_sample_per_rank_stays_put():
    costs = [[float(r + 1)] for r in range(8)]
    plan = balance(costs, 4)
    assert plan.bytes_moved == 0 and plan.moves == []
    assert plan.destinations == [[(r, 0)] for r in range(8)]
    naive = balance(costs, 4, placement="naive")  # LPT bin 0 holds the largest sample
    assert naive.destinations[0] == [(7, 0)] and naive.bytes_moved == 8


def test_naive_maps_bin_i_to_rank_i():
    costs = [[5.0, 1.0, 1.0], [4.0], [], [2.0, 2.0]]
    s = flatten(costs)
    groups = lpt_groups(s.cost, 4)
    plan = balance(costs, 2, placement="naive")
    assert plan.destinations == [sorted((int(s.src[i]), int(s.pos[i])) for i in g)
                                 for g in groups]


def test_byte_accounting_example():
    # 4 ranks, 2 per node: min_move has to move samples off rank 0.
    costs = [[4.0, 4.0, 1.0], [1.0], [1.0], [4.0]]
    sizes = [[10, 20, 30], [1], [2], [3]]
    plan = balance(costs, 2, "min_move", sizes_per_rank=sizes, tolerance=0.0)
    moved = {(r, p): d for r, p, d in plan.moves}
    intra = sum(sizes[r][p] for (r, p), d in moved.items() if r // 2 == d // 2)
    inter = sum(sizes[r][p] for (r, p), d in moved.items() if r // 2 != d // 2)
    assert (plan.bytes_intra_node, plan.bytes_inter_node) == (intra, inter)
    assert plan.bytes_moved == intra + inter > 0
    # Stays (0 bytes), rank 0 -> 1 (intra, 7), 0 -> 2 (inter, 11), 3 -> 0 (inter, 13).
    dest = np.array([0, 1, 2, 0])
    src = np.array([0, 0, 0, 3])
    assert movement(dest, src, np.array([5.0, 7.0, 11.0, 13.0]), 2) == (31.0, 7.0, 24.0)


def test_milp_with_one_node_equals_assignment():
    costs = [[3.0, 1.0], [2.0], [4.0, 1.0, 1.0]]
    assert balance(costs, 8, placement="milp").destinations == balance(costs, 8).destinations


def test_group_and_node_bytes_by_hand_for_more_groups_than_ranks():
    """Three groups over two ranks on one node, and over two nodes of one rank each."""
    src, size = np.asarray([0, 1, 1, 0]), np.asarray([5.0, 7.0, 1.0, 2.0])
    a = group_bytes([[0, 1], [2], [3]], src, size, 2)
    assert a.tolist() == [[5.0, 7.0], [0.0, 1.0], [2.0, 0.0]]
    assert same_node_bytes(a, 2).tolist() == [[12.0, 12.0], [1.0, 1.0], [2.0, 2.0]]
    assert same_node_bytes(a, 1).tolist() == a.tolist()


def test_place_names_an_unknown_method():
    with pytest.raises(ValueError, match=r"^unknown placement 'random'; valid placements: assignment, naive, milp$"):
        place([[0]], np.asarray([0]), np.asarray([1.0]), 1, 1, "random")


@pytest.mark.parametrize("rows, rpn", [
    # fractional bytes: pairs within half a byte of an optimal one are not all tight (a 0.5
    # tolerance here ends on the first optimum found, which sends 2 more bytes across nodes)
    ([[2.25, 3.0, 2.25, 3.0], [2.25, 2.3, 0.0, 2.3], [3.25, 1.25, 2.3, 3.25], [1.25, 3.3, 1.0, 3.3]], 2),
    # whole bytes at terabyte scale, single bytes apart: exact integers, where a relative 1e-12
    # tolerance would take pairs one byte off an optimal one as tight
    ([[2e12, 1e12 + 1, 1e12 + 1, 1e12 + 1], [1e12 + 1, 1e12, 1e12, 1e12],
      [2e12 + 1, 1e12, 1.0, 1.0], [1e12 + 1, 1e12, 2e12 + 1, 2e12 + 1]], 2),
    # fractional bytes: swapping groups 0 and 2 keeps 1e-12 bytes less on their ranks (within
    # the rounding tolerance, so its pairs count as tight) and 2.5 more on their nodes; the
    # second key must not cost the first
    ([[3.5, 0.0, 3.5, 1.25], [0.0, 3.5, 0.0, 0.0], [3.5 - 1e-12, 1.25, 3.5, 0.0], [0.0, 0.0, 0.0, 3.5]], 2),
])
def test_assignment_is_lexicographically_optimal_where_near_ties_mislead(rows, rpn):
    a = np.array(rows, dtype=float)
    b = same_node_bytes(a, rpn)
    def keys(perm):
        return kept_bytes(a, perm), kept_bytes(b, perm)
    best = max(keys(np.array(p)) for p in itertools.permutations(range(len(rows))))
    assert keys(assign_groups(a, rpn)) == best
