"""Properties of balance(): every sample placed once, bounds, exactness, determinism, caps."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odb_factory.balance import StageCostModel, balance

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Heavy tail by construction: log-uniform over 2**-6 .. 2**14 (density ~ 1/c), plus exact zeros.
heavy = st.integers(0, 255).map(lambda v: 0.0 if v == 0 else 2.0 ** (v / 12.75 - 6))


@st.composite
def small_instance(draw, max_ranks=8, max_samples=48):
    """Four bytes per sample (rank, cost, bytes, length): one cheap draw for the whole instance,
    so thousands of examples stay fast, and it still shrinks towards fewer/smaller samples."""
    m = draw(st.integers(1, max_ranks))
    raw = draw(st.binary(max_size=4 * max_samples))
    costs, sizes, lengths = ([[] for _ in range(m)] for _ in range(3))
    for j in range(0, len(raw) - 3, 4):
        r, c, b, ln = raw[j:j + 4]
        costs[r % m].append(0.0 if c == 0 else 2.0 ** (c / 12.75 - 6))
        sizes[r % m].append(4 * b)
        lengths[r % m].append(ln % 64 + 1)
    return costs, sizes, lengths


def seeded_instance(seed: int, m: int, max_per_rank: int, kind: str):
    """Up to 64 x 64 samples drawn with numpy: lognormal or Pareto costs and lengths."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, max_per_rank + 1, m)
    def draw(k):
        if kind == "lognormal":
            return rng.lognormal(0.0, 2.0, k)
        return rng.pareto(1.2, k) + 0.01
    costs = [draw(k).tolist() for k in counts]
    lengths = [np.ceil(64 * draw(k)).tolist() for k in counts]
    sizes = [rng.integers(0, 10**6, k).tolist() for k in counts]
    return costs, sizes, lengths


large_instance = st.builds(seeded_instance, st.integers(0, 2**32), st.integers(1, 64),
                           st.integers(0, 64), st.sampled_from(["lognormal", "pareto"]))


def check_plan(plan, costs, sizes, lengths, ranks_per_node):
    m = len(costs)
    placed = sorted(x for dest in plan.destinations for x in dest)
    assert placed == [(r, p) for r in range(m) for p in range(len(costs[r]))]
    assert len(plan.destinations) == m
    unit = lengths if plan.mode == "padded" else costs
    def rank_cost(values):
        if plan.mode == "padded":
            return len(values) * max(values) if values else 0.0
        return math.fsum(values)
    assert plan.cost_before == [rank_cost(u) for u in unit]
    assert plan.cost_per_rank == [rank_cost([unit[r][p] for r, p in d]) for d in plan.destinations]
    flat = [u for row in unit for u in row]
    assert plan.lower_bound == max(math.fsum(flat) / m, max(flat, default=0.0))
    assert plan.max_over_lb >= 1 - 1e-12
    intra = inter = 0
    for d, dest in enumerate(plan.destinations):
        for r, p in dest:
            if r != d:
                if r // ranks_per_node == d // ranks_per_node:
                    intra += sizes[r][p]
                else:
                    inter += sizes[r][p]
    assert (plan.bytes_intra_node, plan.bytes_inter_node) == (intra, inter)
    assert plan.bytes_moved == plan.bytes_intra_node + plan.bytes_inter_node


def run(costs, sizes, lengths, mode, rpn, placement=None, **kw):
    if mode == "padded":
        kw["lengths_per_rank"] = lengths
    elif mode != "min_move":
        kw["placement"] = placement
    return balance(costs, rpn, mode, sizes_per_rank=sizes, **kw)


@settings(max_examples=2000, **SETTINGS)
@given(small_instance(), st.sampled_from(["lpt", "padded", "min_move"]), st.integers(1, 4),
       st.sampled_from(["assignment", "naive"]))
def test_invariants_small(inst, mode, rpn, placement):
    plan = run(*inst, mode, rpn, placement)
    check_plan(plan, *inst, rpn)
    assert run(*inst, mode, rpn, placement) == plan  # deterministic, bit for bit


@settings(max_examples=300, **SETTINGS)
@given(large_instance, st.sampled_from(["lpt", "padded", "min_move"]), st.sampled_from([1, 8]))
def test_invariants_large(inst, mode, rpn):
    plan = run(*inst, mode, rpn)
    check_plan(plan, *inst, rpn)
    assert run(*inst, mode, rpn) == plan


@settings(max_examples=300, **SETTINGS)
@given(st.one_of(small_instance(max_ranks=64, max_samples=256), large_instance))
def test_lpt_within_list_scheduling_bound(inst):
    # Any list schedule: max <= sum/m + (1 - 1/m) * max c  (and so <= 2 LB). LB <= OPT only.
    costs = inst[0]
    m, flat = len(costs), [c for row in costs for c in row]
    plan = balance(costs, 8, "lpt")
    bound = math.fsum(flat) / m + (1 - 1 / m) * max(flat, default=0.0)
    assert plan.max_cost <= bound * (1 + 1e-12)
    assert plan.max_over_lb <= 2 - 1 / m + 1e-12


@functools.lru_cache(maxsize=None)
def all_assignments(n: int, m: int) -> np.ndarray:
    """Every map of n samples to m ranks, as an (m**n, n) array."""
    return np.indices((m,) * n).reshape(n, -1).T


def brute_force_sum(costs: list[float], m: int) -> float:
    assign = all_assignments(len(costs), m)
    loads = np.zeros((assign.shape[0], m))
    for i, c in enumerate(costs):
        loads[np.arange(assign.shape[0]), assign[:, i]] += c
    return float(loads.max(axis=1).min())


@settings(max_examples=300, **SETTINGS)
@given(st.integers(1, 3), st.lists(heavy, min_size=1, max_size=8))
def test_lpt_within_graham_4_3_of_optimum(m, flat):
    opt = brute_force_sum(flat, m)
    plan = balance([flat] + [[] for _ in range(m - 1)], 8, "lpt")
    assert plan.max_cost <= (4 / 3 - 1 / (3 * m)) * opt * (1 + 1e-12)


def brute_force_padded(unit, lengths, m, max_samples, max_tokens):
    """Min over all assignments of max_rank count * max unit; None if no assignment fits."""
    best = None
    for assign in all_assignments(len(unit), m):
        worst = 0.0
        for r in range(m):
            on = np.flatnonzero(assign == r)
            if on.size == 0:
                continue
            if max_samples is not None and on.size > max_samples:
                break
            if max_tokens is not None and on.size * max(lengths[i] for i in on) > max_tokens:
                break
            worst = max(worst, on.size * max(unit[i] for i in on))
        else:
            best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=300, **SETTINGS)
@given(st.integers(1, 3), st.lists(st.integers(1, 40), min_size=1, max_size=7),
       st.sampled_from([None, StageCostModel(3.0, 1.0, 0.05), StageCostModel(0.0, 0.0, 1.0)]),
       st.one_of(st.none(), st.integers(1, 4)), st.one_of(st.none(), st.integers(1, 120)))
def test_padded_equals_brute_force(m, lengths, model, max_samples, max_tokens):
    unit = [float(x) for x in (lengths if model is None else model(np.array(lengths)))]
    best = brute_force_padded(unit, lengths, m, max_samples, max_tokens)
    kw = dict(lengths_per_rank=[lengths] + [[] for _ in range(m - 1)], cost_model=model,
              max_samples_per_rank=max_samples, token_budget=max_tokens)
    if best is None:
        with pytest.raises(ValueError, match="infeasible caps: .*(max_samples_per_rank|token_budget)="):
            balance([[1.0] * len(lengths)] + [[] for _ in range(m - 1)], 1, "padded", **kw)
        return
    plan = balance([[1.0] * len(lengths)] + [[] for _ in range(m - 1)], 1, "padded", **kw)
    assert plan.max_cost == best


def check_caps(plan, lengths, max_samples, max_tokens):
    for dest in plan.destinations:
        if max_samples is not None:
            assert len(dest) <= max_samples
        if max_tokens is not None and dest:
            assert len(dest) * max(lengths[r][p] for r, p in dest) <= max_tokens


@settings(max_examples=400, **SETTINGS)
@given(st.one_of(small_instance(max_ranks=16, max_samples=128), large_instance),
       st.sampled_from(["lpt", "padded", "min_move"]), st.one_of(st.none(), st.integers(1, 80)),
       st.one_of(st.none(), st.floats(1.0, 5000.0)))
def test_caps_respected_or_clear_error(inst, mode, max_samples, max_tokens):
    costs, sizes, lengths = inst
    m, n = len(costs), sum(map(len, costs))
    kw = dict(max_samples_per_rank=max_samples, token_budget=max_tokens,
              lengths_per_rank=lengths)
    try:
        plan = balance(costs, 4, mode, sizes_per_rank=sizes, **kw)
    except ValueError as exc:
        assert "max_samples_per_rank" in str(exc) or "token_budget" in str(exc)
        # Without a token cap, n <= m * cap is feasible and LPT/min_move always manage it.
        assert max_tokens is not None or (max_samples is not None and n > m * max_samples)
        return
    check_caps(plan, lengths, max_samples, max_tokens)
    if mode == "padded":
        check_plan(plan, costs, sizes, lengths, 4)


def test_padded_cost_model_applies_to_longest_sample():
    model = StageCostModel(1.0, 2.0, 0.5)
    plan = balance([[1, 1, 1]], 1, "padded", lengths_per_rank=[[4, 10, 2]], cost_model=model)
    assert plan.cost_per_rank == [3 * model(10.0)]


def test_padded_without_lengths_uses_costs_as_unit_costs():
    plan = balance([[5.0, 1.0, 1.0, 1.0], []], 8, "padded")
    assert plan.max_cost == 5.0  # [5] alone, the three 1s together: 3 * 1
    assert sorted(map(len, plan.destinations)) == [1, 3]


@settings(max_examples=300, **SETTINGS)
@given(st.one_of(small_instance(), large_instance), st.sampled_from([0.0, 0.05, 0.3]),
       st.sampled_from([1, 2, 8]))
def test_min_move_never_worse_and_reports_target(inst, tol, rpn):
    costs, sizes, _ = inst
    plan = balance(costs, rpn, "min_move", sizes_per_rank=sizes, tolerance=tol)
    assert plan.target == (1 + tol) * plan.lower_bound
    assert plan.target_met == (plan.max_cost <= plan.target)
    assert plan.max_cost <= max(plan.cost_before)
    if max(plan.cost_before) <= plan.target:
        assert plan.bytes_moved == 0 and plan.moves == []


def test_min_move_moves_one_small_sample_within_the_node():
    # Rank 0 is over by 3; only sample (0, 2) fits elsewhere (rank 1, same node) without
    # pushing that rank over the target.
    costs = [[5.0, 5.0, 3.0], [7.0], [10.0], [10.0]]
    sizes = [[100, 100, 5], [1], [1], [1]]
    plan = balance(costs, 2, "min_move", sizes_per_rank=sizes, tolerance=0.0)
    assert plan.lower_bound == 10.0
    assert plan.moves == [(0, 2, 1)]
    assert (plan.bytes_moved, plan.bytes_intra_node, plan.bytes_inter_node) == (5, 5, 0)
    assert plan.target_met


def test_min_move_prefers_a_same_node_destination_over_a_less_loaded_one():
    # Sample (0, 1) fits on rank 1 (same node, load 2) and ranks 2, 3 (other node, 0 and 2).
    plan = balance([[5.0, 3.0], [2.0], [0.0], [2.0]], 2, "min_move",
                   sizes_per_rank=[[9, 1], [1], [1], [1]], tolerance=0.0)
    assert plan.moves == [(0, 1, 1)] and plan.bytes_inter_node == 0


def test_min_move_prefers_cost_per_byte_then_the_cheapest_finisher():
    # Rank 0 must shed 12 with every other rank <= 6: the two 3s (3 bytes) plus the 6 with
    # fewer bytes (10) is the byte-optimal answer (13 bytes, vs 30 for both 6s).
    costs = [[6.0, 6.0, 3.0, 3.0], [0.0], [0.0], [0.0]]
    sizes = [[10, 20, 1, 2], [1], [1], [1]]
    plan = balance(costs, 4, "min_move", sizes_per_rank=sizes, tolerance=0.0)
    assert plan.moves == [(0, 0, 3), (0, 2, 1), (0, 3, 2)]
    assert plan.bytes_moved == 13 and plan.max_cost == 6.0 and plan.target_met


def test_min_move_reports_unreachable_target():
    plan = balance([[3.0, 3.0, 3.0], []], 8, "min_move", tolerance=0.0)
    assert plan.lower_bound == 4.5 and plan.max_cost == 6.0 and plan.target_met is False


def test_min_move_repairs_a_starting_cap_violation():
    plan = balance([[1.0] * 6, [1.0], [1.0]], 8, "min_move", max_samples_per_rank=3)
    assert max(map(len, plan.destinations)) == 3


def test_tie_breaking_is_pinned():
    # Equal costs: LPT visits (0,0), (0,1), (1,0), (1,1) and alternates bins 0, 1.
    plan = balance([[1.0, 1.0], [1.0, 1.0]], 8, "lpt", placement="naive")
    assert plan.destinations == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]


def test_input_types_do_not_change_the_plan():
    rows = [[3.0, 1.5, 0.0], [7.25], [], [2.0, 2.0]]
    ref = balance(rows, 2)
    assert balance([tuple(r) for r in rows], 2) == ref
    assert balance([np.array(r) for r in rows], 2) == ref


def test_empty_and_zero_cost_instances():
    plan = balance([[], [], []], 2)
    assert plan.destinations == [[], [], []] and plan.max_over_lb == 1.0
    plan = balance([[0.0, 0.0], [0.0]], 2, "padded")
    assert plan.max_cost == 0.0 and plan.lower_bound == 0.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(costs_per_rank=[[1.0, -2.0]]), r"costs_per_rank\[0\]\[1\] = -2.0"),
    (dict(costs_per_rank=[[1.0], [float("nan")]]), r"costs_per_rank\[1\]\[0\]"),
    (dict(costs_per_rank=[[float("inf")]]), "finite"),
    (dict(costs_per_rank=[[[1.0]]]), "one-dimensional"),
    (dict(costs_per_rank=[]), "at least one rank"),
    (dict(costs_per_rank="abc"), "one list of numbers per rank"),
    (dict(costs_per_rank=[[1.0, 2.0]], sizes_per_rank=[[1]]), r"sizes_per_rank\[0\] has 1"),
    (dict(costs_per_rank=[[1.0], []], sizes_per_rank=[[1]]), "sizes_per_rank has 1 ranks"),
    (dict(costs_per_rank=[[1.0]], lengths_per_rank=[[1, 2]]), r"lengths_per_rank\[0\] has 2"),
    (dict(costs_per_rank=[[1.0]], mode="fast"), "valid modes: lpt, padded, min_move"),
    (dict(costs_per_rank=[[1.0]], placement="random"),
     "valid placements: assignment, naive, milp"),
    (dict(costs_per_rank=[[1.0]], ranks_per_node=0), r"^ranks_per_node must be an integer >= 1, got 0$"),
    (dict(costs_per_rank=[[1.0]], max_samples_per_rank=0), "max_samples_per_rank"),
    (dict(costs_per_rank=[[1.0]], token_budget=10), "needs lengths_per_rank"),
    (dict(costs_per_rank=[[1.0]], tolerance=0.1), r"^tolerance is only used by mode='min_move'$"),
    (dict(costs_per_rank=[[1.0]], mode="min_move", tolerance=-1), r"^tolerance must be finite and >= 0, got -1$"),
    (dict(costs_per_rank=[[1.0]], mode="min_move", tolerance=True), r"^tolerance must be finite and >= 0, got True$"),
    (dict(costs_per_rank=[[1.0]], mode="min_move", placement="naive"),
     r"^placement does not apply to mode='min_move' \(it moves samples between ranks directly\)$"),
    (dict(costs_per_rank=[[1.0]], cost_model=StageCostModel()), "only used by mode='padded'"),
    (dict(costs_per_rank=[[1.0, 1.0]], mode="padded", lengths_per_rank=[[1, 2]],
          cost_model=lambda x: 5.0 - x), r"^cost_model must be non-decreasing in length for mode='padded'$"),
    (dict(costs_per_rank=[[1.0] * 5], max_samples_per_rank=2),
     "infeasible caps: 5 samples cannot be placed on 1 ranks with max_samples_per_rank=2"),
    (dict(costs_per_rank=[[1.0], []], lengths_per_rank=[[50], []],
          token_budget=40), "token_budget=40"),
])
def test_bad_input_raises_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        balance(**kwargs)


def test_ranks_per_node_defaults_to_nodes_of_eight():
    """Nine ranks by default are two nodes (8 + 1): a sample moved to rank 8 crosses nodes."""
    costs = [[5.0, 4.0, 3.0, 3.0, 2.0, 2.0, 1.0, 1.0, 1.0]] + [[] for _ in range(8)]
    default = balance(costs)
    assert default == balance(costs, 8) != balance(costs, 9)
    assert default.bytes_inter_node == 1.0


@pytest.mark.parametrize("mode, placement, reported", [
    ("lpt", None, "assignment"), ("padded", "naive", "naive"), ("lpt", "milp", "milp"),
    ("min_move", None, "none"),   # its destinations already are ranks
])
def test_a_plan_reports_its_placement(mode, placement, reported):
    plan = balance([[3.0, 2.0, 1.0], [1.0]], 8, mode, lengths_per_rank=[[3, 2, 1], [1]], placement=placement)
    assert plan.placement == reported and plan.mode == mode
