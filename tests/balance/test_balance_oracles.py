"""Balance internals judged by brute force and hand counts: cap feasibility, node traffic,
the MILP placement's full lexicographic objective, min_move's cap repair, and the cost-model
fit's quality figures against an unconstrained least-squares solve written here."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory.balance import StageCostModel, balance, fit_stage_cost_model, lpt_groups
from odb_factory.balance.caps import Caps, fits_on
from odb_factory.balance.inputs import flatten
from odb_factory.balance.milp_placement import _inter_bytes, node_traffic
from odb_factory.balance.placement import group_bytes, nodes_of, place


# ------------------------------------------------------------------ caps

def _fits_by_enumeration(caps, lengths, num_ranks):
    """Try every assignment of samples to ranks."""
    for owner in itertools.product(range(num_ranks), repeat=len(lengths)):
        ok = True
        for r in range(num_ranks):
            mine = [lengths[i] for i in range(len(lengths)) if owner[i] == r]
            if caps.max_samples is not None and len(mine) > caps.max_samples:
                ok = False
            if caps.token_budget is not None and mine and len(mine) * max(mine) > caps.token_budget:
                ok = False
        if ok:
            return True
    return False


def test_caps_describe_themselves_as_error_messages_name_them():
    assert Caps().describe() == "no caps"
    assert Caps(max_samples=3, token_budget=1.5e4).describe() == \
        "max_samples_per_rank=3 and token_budget=15000"


def test_fits_on_hand_cases():
    assert fits_on(Caps(max_samples=2), None, 5, 3) and not fits_on(Caps(max_samples=2), None, 5, 2)
    desc = np.array([6.0, 5.0, 4.0, 3.0])
    tokens = Caps(token_budget=10)
    # 6 alone (2 * 6 > 10), then {5, 4} (2 * 5 = 10), then 3 needs a third rank
    assert not fits_on(tokens, desc, 4, 2) and fits_on(tokens, desc, 4, 3)
    assert not fits_on(tokens, np.array([11.0]), 1, 5)     # one sample over the cap alone
    assert fits_on(tokens, desc[:0], 0, 1) and fits_on(Caps(), None, 9, 1)


@settings(max_examples=400)
@given(st.lists(st.integers(1, 12), max_size=6), st.integers(1, 3),
       st.one_of(st.none(), st.integers(1, 4)), st.one_of(st.none(), st.integers(1, 30)))
def test_fits_on_equals_enumeration(lengths, num_ranks, max_samples, max_tokens):
    caps = Caps(max_samples, max_tokens)
    desc = np.sort(np.array(lengths, dtype=float))[::-1]
    assert fits_on(caps, desc, len(lengths), num_ranks) == _fits_by_enumeration(caps, lengths, num_ranks)


# ------------------------------------------------------------------ node traffic and milp

def _keys_by_hand(a, perm, rpn):
    """(busiest node's max(egress, ingress), inter-node bytes, -bytes kept on their rank) when
    group g goes to rank perm[g]; a[g, r] = bytes of group g from rank r."""
    m = a.shape[1]
    nodes = (m + rpn - 1) // rpn
    egress, ingress = [0.0] * nodes, [0.0] * nodes
    inter = kept = 0.0
    for g in range(a.shape[0]):
        for r in range(m):
            if r == perm[g]:
                kept += a[g, r]
            if r // rpn != perm[g] // rpn:
                egress[r // rpn] += a[g, r]
                ingress[perm[g] // rpn] += a[g, r]
                inter += a[g, r]
    return max(egress + ingress), inter, -kept


def test_node_traffic_and_inter_bytes_by_hand():
    # 4 ranks, 2 per node. Group 0 (from ranks 0 and 2) lands on rank 0; group 1 (rank 3) on
    # rank 1; groups 2 and 3 stay on ranks 2 and 3.
    a = np.array([[5.0, 0, 7, 0], [0, 0, 0, 11], [0, 0, 2, 0], [0, 0, 0, 3]])
    perm = np.array([0, 1, 2, 3])
    # node 1 sends 7 + 11 = 18 to node 0; node 0 sends nothing; ingress node 0 = 18
    assert node_traffic(a, perm, 2) == 18.0
    assert _inter_bytes(a, perm, nodes_of(4, 2)) == 18.0
    swapped = np.array([2, 3, 0, 1])  # node 0 sends 5 (group 0), node 1 sends 2 + 3
    assert node_traffic(a, swapped, 2) == 5.0
    assert _inter_bytes(a, swapped, nodes_of(4, 2)) == 5 + 2 + 3
    for p in (perm, swapped):
        assert (node_traffic(a, p, 2), _inter_bytes(a, p, nodes_of(4, 2))) == _keys_by_hand(a, p, 2)[:2]
    # three one-rank nodes: node 0 receives 4 + 6 (the busiest direction), nodes 1, 2 send 4, 6
    a3 = np.array([[0.0, 4, 6], [0, 0, 0], [0, 0, 0]])
    assert node_traffic(a3, np.array([0, 1, 2]), 1) == 10.0
    assert _inter_bytes(a3, np.array([0, 1, 2]), nodes_of(3, 1)) == 10.0
    assert node_traffic(a3, np.array([2, 0, 1]), 1) == 4.0     # group 0 on rank 2: only 4 travels
    # node 1 sends 4 + 5 in two groups (egress is per node, not per group)
    a3b = np.array([[0.0, 4, 0], [0, 5, 0], [0, 0, 0]])
    assert node_traffic(a3b, np.array([0, 2, 1]), 1) == 9.0
    # node 0 receives 4 (from node 1) + 5 (from node 2) in two groups
    a6 = np.zeros((6, 6))
    a6[0, 2], a6[1, 4] = 4.0, 5.0
    assert node_traffic(a6, np.arange(6), 2) == 9.0
    assert _keys_by_hand(a3b, [0, 2, 1], 1)[0] == _keys_by_hand(a6, list(range(6)), 2)[0] == 9.0


@st.composite
def small_instance(draw):
    m = draw(st.integers(2, 6))
    raw = draw(st.lists(st.tuples(st.integers(0, m - 1), st.integers(1, 9), st.integers(0, 300)),
                        max_size=14))
    costs, sizes = [[] for _ in range(m)], [[] for _ in range(m)]
    for r, c, b in raw:
        costs[r].append(float(c))
        sizes[r].append(b)
    return costs, sizes


@settings(max_examples=120)
@given(small_instance(), st.sampled_from([1, 2, 3]))
def test_milp_placement_is_lexicographically_optimal(inst, rpn):
    """Over all rank permutations of the groups: least busiest-node traffic, then least
    inter-node bytes, then most bytes kept in place, counted here from the bytes matrix."""
    costs, sizes = inst
    s = flatten(costs, sizes)
    m = s.num_ranks
    groups = lpt_groups(s.cost, m)
    a = group_bytes(groups, s.src, s.size, m)
    perm = place(groups, s.src, s.size, m, rpn, "milp")
    best = min(_keys_by_hand(a, p, rpn) for p in itertools.permutations(range(m)))
    assert _keys_by_hand(a, perm, rpn) == best
    plan = balance(costs, rpn, placement="milp", sizes_per_rank=sizes)
    assert (plan.bytes_inter_node, plan.bytes_moved) == (best[1], float(np.sum(a)) + best[2])


def test_milp_beats_assignment_with_two_nodes():
    costs = [[7.0, 1.0, 7.0], [5.0, 6.0], [8.0], [3.0]]
    sizes = [[8, 11, 8], [3, 1], [1], [1]]
    s = flatten(costs, sizes)
    groups = lpt_groups(s.cost, 4)
    a = group_bytes(groups, s.src, s.size, 4)
    traffic = {method: _keys_by_hand(a, place(groups, s.src, s.size, 4, 2, method), 2)[0]
               for method in ("assignment", "milp")}
    assert traffic == {"assignment": 8.0, "milp": 4.0}


def test_milp_second_stage_lowers_inter_node_bytes():
    """An instance where the busiest-node optimum is not unique: the second MILP (least
    inter-node bytes at that traffic) is what reaches the lexicographic optimum (32, 62)."""
    costs = [[], [4.0], [4.0, 1.0, 3.0], [7.0, 6.0], [2.0, 8.0, 1.0], [3.0, 2.0]]
    sizes = [[], [19], [9, 16, 7], [4, 22], [12, 20, 20], [28, 12]]
    s = flatten(costs, sizes)
    groups = lpt_groups(s.cost, 6)
    a = group_bytes(groups, s.src, s.size, 6)
    best = min(_keys_by_hand(a, p, 2) for p in itertools.permutations(range(6)))
    assert best[:2] == (32.0, 62.0)
    assert _keys_by_hand(a, place(groups, s.src, s.size, 6, 2, "milp"), 2) == best
    plan = balance(costs, 2, placement="milp", sizes_per_rank=sizes)
    assert plan.bytes_inter_node == 62.0


def test_min_move_reports_infeasible_sample_caps():
    with pytest.raises(ValueError, match=r"^infeasible caps: 6 samples cannot be placed on 2 ranks with "
                                         r"max_samples_per_rank=2$"):
        balance([[1.0] * 6, []], 8, "min_move", max_samples_per_rank=2)


def test_milp_is_quiet(capfd):
    """The solver runs without console output or warnings (every option is one HiGHS knows)."""
    rng = np.random.default_rng(7)
    costs = [rng.lognormal(0, 1.5, 4).tolist() for _ in range(8)]
    sizes = [rng.integers(1, 1000, 4).tolist() for _ in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        balance(costs, 2, placement="milp", sizes_per_rank=sizes)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# ------------------------------------------------------------------ min_move's cap repair

def test_repair_moves_the_longest_sample_off_a_rank_over_the_token_cap():
    # rank 0 holds lengths 10 and 2 (2 * 10 > 12): the 10 leaves, although it has more bytes
    plan = balance([[1.0, 1.0], []], 8, "min_move", sizes_per_rank=[[100, 1], []],
                   lengths_per_rank=[[10, 2], []], token_budget=12,
                   max_samples_per_rank=2, tolerance=10.0)
    assert plan.moves == [(0, 0, 1)]


def test_repair_leaves_a_rank_exactly_at_its_caps():
    plan = balance([[1.0, 1.0], [0.0]], 8, "min_move", lengths_per_rank=[[5, 5], [1]],
                   token_budget=10, max_samples_per_rank=2, tolerance=10.0)
    assert plan.moves == []


def test_repair_moves_the_fewest_bytes_off_a_rank_over_the_sample_cap():
    plan = balance([[1.0, 1.0, 1.0], [0.0]], 8, "min_move", sizes_per_rank=[[5, 1, 9], [1]],
                   max_samples_per_rank=2, tolerance=10.0)
    assert plan.moves == [(0, 1, 1)]


@pytest.mark.parametrize("kwargs", [
    dict(lengths_per_rank=[[30, 30], [30]], token_budget=40),   # needs 3 ranks
    dict(lengths_per_rank=[[50], [1]], token_budget=40),        # one alone is over
])
def test_repair_reports_infeasible_token_caps(kwargs):
    costs = [[1.0] * len(r) for r in kwargs["lengths_per_rank"]]
    with pytest.raises(ValueError, match=r"^infeasible caps: \d+ samples cannot be placed on 2 ranks"):
        balance(costs, 8, "min_move", **kwargs)


@pytest.mark.parametrize("costs, lengths, cap, message", [
    # LPT puts 10 and 10 on separate ranks, then the 20 fits nowhere; {10, 10} | {20} fits
    ([[10.0, 9.0, 1.0], []], [[10, 10, 20], []], 20,
     r"^LPT could not place a sample of cost 1 and length 20 within token_budget=20 "
     r"although a feasible placement exists; use mode='padded' \(exact under caps\) or relax the caps$"),
    ([[1.0, 1.0], []], [[50, 1], []], 40,
     r"^infeasible caps: 2 samples cannot be placed on 2 ranks with token_budget=40$"),
    ([[1.0, 1.0, 1.0], []], [[30, 30, 30], []], 40,
     r"^infeasible caps: 3 samples cannot be placed on 2 ranks with token_budget=40$"),
])
def test_lpt_failure_says_whether_the_caps_are_feasible(costs, lengths, cap, message):
    with pytest.raises(ValueError, match=message):
        balance(costs, 8, "lpt", lengths_per_rank=lengths, token_budget=cap)


# ------------------------------------------------------------------ cost-model fit quality

def _lstsq_quality(lengths, times):
    x = np.stack([np.ones_like(lengths), lengths, lengths ** 2], axis=1)
    coef = np.linalg.lstsq(x, times, rcond=None)[0]
    pred = x @ coef
    r2 = 1 - np.sum((times - pred) ** 2) / np.sum((times - times.mean()) ** 2)
    pos = times > 0
    return coef, r2, float(np.mean(np.abs(pred[pos] - times[pos]) / times[pos]))


@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_fit_quality_equals_unconstrained_least_squares(scale):
    """Where the unconstrained optimum is non-negative, nnls finds it: same coefficients, R^2
    and mean relative error (times below 1 included)."""
    lengths = np.array([1.0, 2, 3, 5, 8, 13, 21, 34])
    times = scale * (4.0 + 2.0 * lengths + 0.05 * lengths ** 2
                     + np.array([0.3, -0.2, 0.1, 0.4, -0.5, 0.2, -0.3, 0.6]))
    coef, r2, mre = _lstsq_quality(lengths, times)
    assert min(coef) > 0
    fit = fit_stage_cost_model(lengths, times)
    np.testing.assert_allclose([fit.model.c0, fit.model.a, fit.model.b], coef, rtol=1e-7)
    assert fit.r2 == pytest.approx(r2, rel=1e-9) and 0.99 < fit.r2 < 1
    assert fit.mean_rel_error == pytest.approx(mre, rel=1e-6) and fit.mean_rel_error > 0


def test_exact_fit_through_a_zero_time_has_r2_one():
    fit = fit_stage_cost_model([0, 1, 2, 3], [0.0, 2.0, 4.0, 6.0])
    assert fit.r2 == pytest.approx(1.0) and fit.model.a == pytest.approx(2.0)
    assert fit.mean_rel_error == pytest.approx(0.0, abs=1e-9)
    assert isinstance(fit.model, StageCostModel)


def test_fit_error_messages_are_whole():
    with pytest.raises(ValueError, match=r"^fit_stage_cost_model needs at least one \(length, time\) pair$"):
        fit_stage_cost_model([], [])
    with pytest.raises(ValueError, match=r"^lengths has 2 entries but times has 1$"):
        fit_stage_cost_model([1, 2], [1.0])
    with pytest.raises(ValueError, match=r"^times must be finite and non-negative$"):
        fit_stage_cost_model([1], [-1.0])


@pytest.mark.parametrize("cap", [0, -1.0, float("nan"), float("inf"), True, "40"])
def test_token_cap_must_be_a_positive_finite_number(cap):
    with pytest.raises(ValueError, match=r"^token_budget must be finite and > 0, got "):
        balance([[1.0]], 8, lengths_per_rank=[[1]], token_budget=cap)


def test_both_caps_are_named_in_errors():
    with pytest.raises(ValueError, match=r"^infeasible caps: 3 samples cannot be placed on 1 ranks with "
                                         r"max_samples_per_rank=2 and token_budget=40$"):
        balance([[1.0] * 3], 8, "padded", lengths_per_rank=[[5, 5, 5]], max_samples_per_rank=2,
                token_budget=40)
