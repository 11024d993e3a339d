"""Property tests of the pure planner over simulated worlds of 1-16 ranks.

These check exactly the claims of docs/dgap.md: bounded rounds, equal step counts on every
rank, exact coverage (join), exact quota (non-join), and no group over the budget except
the over-budget policy's singletons.
"""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odb_factory import ODBConfig, SampleCost
from odb_factory.planning.alignment import RankStatus, fit_to_target, target_groups, trim_to_quota
from odb_factory.planning.grouping import Budget, PlannedSample, form_groups
from odb_factory.planning.simulated_world import round_bound, simulate_epoch

# Length profiles: typical, identical, extreme outliers, tiny.
lengths_st = st.one_of(
    st.lists(st.integers(1, 600), min_size=1, max_size=120),
    st.integers(1, 300).flatmap(lambda n: st.lists(st.just(n), min_size=1, max_size=80)),
    st.lists(st.one_of(st.integers(1, 20), st.integers(5000, 20000)), min_size=1, max_size=80),
)


@st.composite
def worlds(draw):
    lengths = draw(lengths_st)
    n = len(lengths)
    world = draw(st.integers(1, 16))
    costs = [SampleCost(l, draw(st.integers(0, l)), draw(st.sampled_from([0, 0, 16, 256])))
             for l in lengths]
    # Views: the default deal, or arbitrary uneven (possibly empty) shards.
    if draw(st.booleans()):
        views = None
    else:
        owner = draw(st.lists(st.integers(0, world - 1), min_size=n, max_size=n))
        views = [[i for i in range(n) if owner[i] == r] for r in range(world)]
    cfg = ODBConfig(
        token_budget=draw(st.sampled_from([1, 16, 64, 512, 4096])),
        join=draw(st.booleans()),
        buffer_size=draw(st.integers(1, 40)),
        pad_to_multiple_of=draw(st.sampled_from([1, 8, 64])),
        cost_mode=draw(st.sampled_from(["padded", "packed"])),
        max_vision_patches=draw(st.sampled_from([None, 300, 2048])),
        quota=draw(st.one_of(st.none(), st.integers(1, 3 * n))),
        seed=draw(st.integers(0, 3)),
    )
    return costs, world, views, cfg


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_protocol_guarantees(case):
    costs, world, views, cfg = case
    sim = simulate_epoch(costs, cfg, world, views=views)  # raises if the round bound is exceeded
    assert sim.rounds <= round_bound(sim.views, cfg.join, cfg.quota or len(costs))
    # same number of steps on every rank
    assert len({len(slots) for slots in sim.slots}) == 1
    trained = sim.trained_indices()
    if cfg.join:
        assert sorted(trained) == sorted(i for v in sim.views for i in v)
    elif any(sim.views):
        assert len(trained) == (cfg.quota or len(costs))
    else:
        assert trained == []
    budget = Budget.from_config(cfg)
    for step in range(sim.steps):
        row = [sim.slots[r][step] for r in range(world)]
        assert any(not s.is_idle for s in row), "no step is idle on every rank"
        assert len({s.global_label_tokens for s in row}) == 1
        assert row[0].global_samples == sum(len(s.samples) for s in row)
        if cfg.gradient_accumulation_steps == 1:
            assert row[0].global_label_tokens == sum(s.label_tokens for s in row)
        for slot in row:
            if len(slot.samples) > 1:
                assert budget.fits(slot.samples), "only a lone sample may exceed the budget"


def _min_runs(ordered, budget):
    """Fewest groups over all partitions of the sorted order into feasible runs (DP)."""
    @functools.lru_cache(None)
    def best(i):
        if i == len(ordered):
            return 0
        options = [1 + best(j) for j in range(i + 1, len(ordered) + 1)
                   if j == i + 1 or budget.fits(ordered[i:j])]
        return min(options)
    return best(0)


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 64)), min_size=0, max_size=14),
       st.sampled_from([1, 50, 300, 1000]), st.sampled_from(["padded", "packed"]),
       st.sampled_from([None, 100]), st.sampled_from([1, 16]))
def test_grouping_is_minimal_and_feasible(items, limit, mode, cap, multiple):
    samples = [PlannedSample(i, i, SampleCost(t, t, v)) for i, (t, v) in enumerate(items)]
    budget = Budget(limit, mode, multiple, cap)
    grouping = form_groups(samples, budget)
    flat = [s.uid for g in grouping.groups for s in g]
    assert sorted(flat) == list(range(len(samples)))
    for group in grouping.groups:
        assert budget.fits(group) or (len(group) == 1 and group[0] in grouping.over_budget)
    ordered = sorted(samples, key=lambda s: (-s.cost.input_tokens, -s.cost.vision_patches, s.uid))
    assert len(grouping.groups) == _min_runs(tuple(ordered), budget)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.lists(st.integers(1, 100), min_size=1, max_size=8), min_size=1, max_size=10),
       st.integers(1, 40))
def test_fit_to_target_conserves_samples(group_lengths, target):
    uid = iter(range(10 ** 6))
    groups = [[PlannedSample(next(uid), 0, SampleCost(l, l)) for l in g] for g in group_lengths]
    total = sum(map(len, groups))
    fit = fit_to_target(groups, target, Budget(10 ** 6), shuffle_seed="s")
    assert len(fit.slots) == target
    kept = [s.uid for slot in fit.slots for s in slot]
    back = [s.uid for s in fit.recirculated]
    assert sorted(kept + back) == list(range(total))
    if len(groups) >= target:
        assert fit.splits == 0 and all(fit.slots)
    else:
        assert not fit.recirculated
        assert sum(1 for s in fit.slots if s) == min(target, total)


@given(st.lists(st.lists(st.integers(0, 9), min_size=3, max_size=3), min_size=1, max_size=6),
       st.integers(0, 100))
def test_trim_to_quota_is_exact(sizes, remaining):
    kept, target = trim_to_quota(sizes, remaining)
    assert sum(map(sum, kept)) == min(remaining, sum(map(sum, sizes)))
    for r, row in enumerate(kept):
        assert len(row) == target
        assert all(0 <= k <= sizes[r][s] for s, k in enumerate(row))


def test_target_examples():
    # streaming ranks bound the target by their own group counts
    assert target_groups([RankStatus(4, 40, False), RankStatus(6, 40, False)]) == 4
    # a draining rank does not lower the target: it splits instead
    assert target_groups([RankStatus(5, 40, False), RankStatus(1, 3, True)]) == 5
    # all draining: the fewest slots that empty every buffer
    assert target_groups([RankStatus(2, 9, True), RankStatus(3, 3, True), RankStatus(0, 0, True)]) == 3
    assert target_groups([RankStatus(0, 0, True)] * 3) == 0


def test_a_streaming_rank_with_more_groups_overflows_and_counts_them():
    # rank 0's window holds 8 one-sample groups, rank 1's 2 groups of 4: the target is 2,
    # so rank 0 keeps 2 groups and sends 6 back to its window
    costs = [SampleCost(40, 40)] * 20 + [SampleCost(10, 10)] * 20
    cfg = ODBConfig(token_budget=40, buffer_size=8)
    sim = simulate_epoch(costs, cfg, 2, views=[list(range(0, 20)), list(range(20, 40))])
    first = sim.stats[0][0]
    assert (first.target, first.overflow_groups, first.splits) == (2, 6, 0)
    assert sorted(sim.trained_indices()) == list(range(40))


def test_join_draining_rank_splits_instead_of_idling():
    costs = [SampleCost(10, 10)] * 44
    cfg = ODBConfig(token_budget=40, buffer_size=8)
    sim = simulate_epoch(costs, cfg, 2, views=[list(range(0, 40)), list(range(40, 44))])
    assert sorted(sim.trained_indices()) == list(range(44))
    first_round = sim.stats[1][0]
    assert first_round.target == 2 and first_round.splits == 1 and first_round.idle_slots == 0
    assert sim.stats[0][0].overflow_groups == 0
