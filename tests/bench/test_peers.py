"""The strong peers of bench/peers.py and the independent lower bound: verl's functions run as
verl runs them, the packers keep L_max and memory, dealt-in-order methods cut the same batches,
and no schedule of any method, under either attention backend, beats the bound."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench import lab as L
from bench import methods as M
from bench import peers, tables
from bench import workloads as P
from bench.step_model import H20_1NODE, QWEN3_VL_8B, build_step_model

M8 = build_step_model(QWEN3_VL_8B, H20_1NODE, "full", mfu=0.7)


@pytest.fixture(scope="module")
def verl():
    module, why = peers.verl_module()
    assert module is not None, why
    return module


@pytest.mark.parametrize("sorted_windows", [False, True])
def test_verl_peer_is_verls_balance_then_verls_micro_batches(verl, sorted_windows):
    """Every global batch: verl's KK deals equal counts to the ranks, each rank's micro-batches
    hold at most max_token_len tokens (a longer sample alone), every rank runs the same count,
    and one optimizer step ends each global batch. verl refuses samples over max_token_len, so
    it is raised to the longest sample."""
    p, world, batch = P.sharegpt4o(900, seed=5), 4, 40
    s = peers.verl_dynamic(p, world, 6000, batch, sorted_windows=sorted_windows)
    budget = int(p.tokens.max())
    assert budget > 6000 and f"max_token_len {budget}" in s.note
    assert s.cost_mode == "packed" and s.optimizer_steps == -(-len(p) // batch)
    start = 0
    for number, end in enumerate(s.step_ends):
        steps = s.steps[start:end + 1]
        per_rank = [np.concatenate([step[r] for step in steps]) for r in range(world)]
        size = sum(len(x) for x in per_rank)
        assert size == batch or number == len(s.step_ends) - 1 or sorted_windows
        if size == batch:
            assert [len(x) for x in per_rank] == [batch // world] * world
            lengths = p.tokens[np.concatenate(per_rank)]
            workload = verl.calculate_workload(lengths).tolist()
            want = verl.get_seqlen_balanced_partitions(workload, world, equal_size=True)
            got_loads = sorted(float(np.sum(verl.calculate_workload(p.tokens[x]))) for x in per_rank)
            want_loads = sorted(float(sum(workload[i] for i in part)) for part in want)
            assert got_loads == pytest.approx(want_loads)
        for step in steps:
            for b in step:
                assert p.tokens[b].sum() <= budget
            assert any(len(b) for b in step)
        start = end + 1


def test_windows_sort_each_window_into_neighbouring_global_batches(verl):
    p = P.ultrachat(1200, seed=2)
    plain = peers._global_batches(p, 24, 0, sorted_windows=False)
    windows = peers._global_batches(p, 24, 0, sorted_windows=True)
    assert sorted(np.concatenate(plain).tolist()) == sorted(np.concatenate(windows).tolist()) == list(range(len(p)))
    spread = lambda batches: np.mean([np.ptp(p.tokens[b]) for b in batches])  # noqa: E731
    assert spread(windows) < 0.25 * spread(plain)


def test_packers_keep_the_budget_and_memory_and_resplit_by_cost(verl):
    p, world = P.mm_mix(1500, seed=4), 8
    cost = peers.sample_seconds_of(p, M8)
    for window in (world * 64, len(p)):
        s = peers.window_pack(p, world, p.token_budget, window, cost, M8.fits)
        assert s.extra["resplit_steps"] > 0
        for step in s.steps:
            for b in step:
                if len(b):
                    assert M8.fits(int(p.tokens[b].sum()), int(p.patches[b].sum()))
    bins = peers.knapsack_bins(p.tokens.tolist(), 4096)
    assert sorted(i for b in bins for i in b) == list(range(len(p)))
    assert all(len(b) == 1 or p.tokens[b].sum() <= 4096 for b in bins)


def test_dealt_in_order_cuts_the_same_batches():
    p, world = P.ultrachat(1000, seed=1), 4
    for build in (M.gmt, M.bmt, M.packing):
        shuffled, ordered = build(p, world, p.token_budget), build(p, world, p.token_budget, shuffle=False)
        as_set = lambda s: sorted(tuple(sorted(b.tolist())) for step in s.steps for b in step if len(b))  # noqa: E731
        assert as_set(shuffled) == as_set(ordered) and ordered.method.endswith("_ordered")


@pytest.mark.parametrize("make", [P.ultrachat, P.sharegpt4o])
def test_no_method_beats_the_lower_bound_under_either_backend(make):
    """Every method of a row (ODB's variants, the peers, the baselines) under both attention
    backends takes at least the L_max bound's time, which is at least the memory-cap bound's;
    the peer table's ratios are the results' own."""
    p = make(1500, seed=6)
    lab = L.Lab(seed=0)
    row = L.evaluate_row(lab, p, "8B", "1n-full", mfu=0.7)
    bounds = row["bounds"]
    assert bounds["memory cap"].time_s <= bounds["L_max"].time_s
    assert {"verl", "verl_windows", "window_pack", "epoch_pack", "gmt_ordered"} <= set(row["results"])
    for backend, results in row["results_by_backend"].items():
        for name, r in results.items():
            assert r.samples == len(p)
            assert r.time_s >= bounds["L_max"].time_s * (1 - 1e-9), (backend, name)
        line = tables.peer_rows([row], backend)[0]
        ours = max(r.samples_per_s for k, r in results.items() if k in tables.ODB_VARIANTS)
        assert line["ODB / bound (L_max)"] == pytest.approx(ours / bounds["L_max"].samples_per_s)
        window = max(r.samples_per_s for k, r in results.items()
                     if k not in tables.ODB_VARIANTS + tables.NOT_COMPARED + tables.EPOCH_CACHE)
        assert line["ODB / it"] == pytest.approx(ours / window)
    # packed schedules cost more through the dense mask; padded ones the same
    seg, mask = row["results_by_backend"]["segments"], row["results_by_backend"]["mask"]
    assert mask["odb_pf"].time_s > seg["odb_pf"].time_s and mask["odb"].time_s == seg["odb"].time_s


def test_the_bound_is_work_over_ranks_plus_the_fewest_steps_fixed_costs():
    p = P.llava(800, seed=1)
    m = replace(M8, comm_micro_s=0.01, comm_opt_s=0.02, optimizer_s=0.03)
    b = peers.lower_bound(p, m, 8, 4096, "x")
    steps = int(np.ceil(p.tokens.sum() / (8 * 4096)))
    work = (m.token_cost(p.tokens) + m.vision_seconds(p.images, p.patches, p.patch_sq)).sum() / 8
    assert b.micro_steps == steps
    assert b.time_s == pytest.approx(work + steps * (m.c0 + 0.06))
