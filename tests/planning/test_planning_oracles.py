"""The pure planner judged by something other than itself: hand-computed cases, brute force,
and second formulations written here (test_protocol_properties.py checks the protocol's
claims; these pin the individual decisions those claims rest on)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory import ODBConfig, SampleCost
from odb_factory.planning.alignment import RankStatus, fit_to_target, target_groups, trim_to_quota
from odb_factory.planning.grouping import Budget, OverBudgetError, PlannedSample, form_groups
from odb_factory.planning.rounds import RankPlanner
from odb_factory.planning.simulated_world import (SimulatedEpoch, planned_stream, round_bound,
                                                  simulate_epoch)
from odb_factory.planning.views import cycling_view, epoch_view
from tests.planning.test_protocol_properties import worlds


def sample(uid, tokens, labels=None, patches=0, index=None, frames=0):
    return PlannedSample(uid, uid if index is None else index,
                         SampleCost(tokens, tokens if labels is None else labels, patches, frames))


def uids(groups):
    return [[s.uid for s in g] for g in groups]


def roundup(tokens, multiple):
    """Smallest multiple of `multiple` that is >= tokens, by counting up."""
    return next(p for p in itertools.count(0, multiple) if p >= tokens)


# ------------------------------------------------------------------ budget and rounding

def test_padded_length_hand_values():
    b = Budget(100, pad_to_multiple_of=8)
    assert [b.padded_length(t) for t in (0, 1, 7, 8, 9, 16, 17)] == [0, 8, 8, 8, 16, 16, 24]
    assert [Budget(100).padded_length(t) for t in (1, 9, 17)] == [1, 9, 17]
    assert Budget(100, pad_to_multiple_of=64).padded_length(65) == 128


@settings(max_examples=1500)
@given(st.integers(0, 10**6), st.integers(1, 4096))
def test_padded_length_is_the_next_multiple(tokens, multiple):
    padded = Budget(1, pad_to_multiple_of=multiple).padded_length(tokens)
    assert padded % multiple == 0 and tokens <= padded < tokens + multiple
    if tokens <= 4 * multiple:
        assert padded == roundup(tokens, multiple)


def test_group_cost_hand_values():
    group = [sample(0, 5), sample(1, 9), sample(2, 3)]
    assert Budget(100, "padded", 8).group_cost(group) == 3 * 16
    assert Budget(100, "padded", 1).group_cost(group) == 3 * 9
    assert Budget(100, "packed", 8).group_cost(group) == 17     # packing does not pad
    assert Budget(100).group_cost([]) == Budget(100, "packed").group_cost([]) == 0


def test_fits_boundaries():
    group = [sample(0, 9, patches=30), sample(1, 4, patches=20)]  # padded 2 * 16 = 32
    assert Budget(32, pad_to_multiple_of=8).fits(group)
    assert not Budget(31, pad_to_multiple_of=8).fits(group)
    assert Budget(32, pad_to_multiple_of=8, max_vision_patches=50).fits(group)
    assert not Budget(32, pad_to_multiple_of=8, max_vision_patches=49).fits(group)
    assert not Budget(31, pad_to_multiple_of=8, max_vision_patches=10**6).fits(group)
    assert Budget(13, "packed", max_vision_patches=50).fits(group)
    assert not Budget(12, "packed").fits(group)


def test_fits_alone_hand_values():
    # padded: 9 tokens round up to 16 under a multiple of 8; packed: 9 is 9
    assert Budget(16, pad_to_multiple_of=8).fits_alone(SampleCost(9, 9))
    assert not Budget(15, pad_to_multiple_of=8).fits_alone(SampleCost(9, 9))
    assert Budget(9, "packed", pad_to_multiple_of=8).fits_alone(SampleCost(9, 9))
    assert not Budget(8, "packed").fits_alone(SampleCost(9, 9))
    assert not Budget(100, max_vision_patches=29).fits_alone(SampleCost(9, 9, 30))
    assert not Budget(100, max_audio_frames=99).fits_alone(SampleCost(9, 9, 0, 100))
    assert Budget(100, max_vision_patches=30, max_audio_frames=100).fits_alone(SampleCost(9, 9, 30, 100))


@settings(max_examples=300)
@given(st.integers(0, 300), st.integers(0, 50), st.integers(0, 50), st.integers(1, 300),
       st.sampled_from(["padded", "packed"]), st.integers(1, 16),
       st.one_of(st.none(), st.integers(0, 50)), st.one_of(st.none(), st.integers(0, 50)))
def test_fits_alone_is_fits_of_a_one_sample_group(tokens, patches, frames, budget, mode, multiple,
                                                  vision_cap, audio_cap):
    b = Budget(budget, mode, multiple, vision_cap, audio_cap)
    cost = SampleCost(tokens, tokens, patches, frames)
    assert b.fits_alone(cost) == b.fits([PlannedSample(0, 0, cost)])


def test_budget_from_config():
    cfg = ODBConfig(token_budget=77, cost_mode="packed", pad_to_multiple_of=4, max_vision_patches=9,
                    max_audio_frames=5)
    assert Budget.from_config(cfg) == Budget(77, "packed", 4, 9, 5)


def test_rounding_changes_the_grouping():
    """Three samples of 9 tokens under 32: unpadded 3 * 9 = 27 fits one group; padded to 8
    they occupy 16 each, and only two fit (2 * 16 = 32)."""
    samples = [sample(i, 9) for i in range(3)]
    assert uids(form_groups(samples, Budget(32)).groups) == [[0, 1, 2]]
    assert uids(form_groups(samples, Budget(32, pad_to_multiple_of=8)).groups) == [[0, 1], [2]]
    assert uids(form_groups(samples, Budget(31, pad_to_multiple_of=8)).groups) == [[0], [1], [2]]


def test_form_groups_hand_example():
    # longest first, ties by vision patches then uid; a run grows while n * max fits
    samples = [sample(0, 3), sample(1, 10), sample(2, 7), sample(3, 10, patches=5), sample(4, 2)]
    grouping = form_groups(samples, Budget(20))
    assert uids(grouping.groups) == [[3, 1], [2, 0], [4]]    # 2*10 = 20; 3*10 > 20; 3*7 = 21 > 20
    assert uids(form_groups(samples, Budget(21)).groups) == [[3, 1], [2, 0, 4]]
    assert uids(form_groups(samples, Budget(30)).groups) == [[3, 1, 2], [0, 4]]
    assert uids(form_groups(samples, Budget(20, "packed")).groups) == [[3, 1], [2, 0, 4]]
    assert grouping.over_budget == []


def test_over_budget_samples_train_alone_by_default():
    samples = [sample(0, 30), sample(1, 5), sample(2, 4)]
    grouping = form_groups(samples, Budget(20))   # no policy given: "singleton"
    assert uids(grouping.groups) == [[0], [1, 2]] and uids([grouping.over_budget]) == [[0]]


def test_packed_groups_sum_lengths():
    samples = [sample(0, 6), sample(1, 5), sample(2, 4), sample(3, 3)]
    assert uids(form_groups(samples, Budget(11, "packed")).groups) == [[0, 1], [2, 3]]
    assert uids(form_groups(samples, Budget(15, "packed")).groups) == [[0, 1, 2], [3]]
    assert uids(form_groups(samples, Budget(15, "padded")).groups) == [[0, 1], [2, 3]]


def test_vision_cap_cuts_a_run():
    samples = [sample(0, 5, patches=40), sample(1, 4, patches=30), sample(2, 3, patches=30)]
    assert uids(form_groups(samples, Budget(100, max_vision_patches=70)).groups) == [[0, 1], [2]]
    assert uids(form_groups(samples, Budget(100, max_vision_patches=100)).groups) == [[0, 1, 2]]
    assert uids(form_groups(samples, Budget(100, max_vision_patches=69)).groups) == [[0], [1, 2]]


def test_audio_cap_cuts_a_run_and_names_itself():
    samples = [sample(0, 5, frames=900), sample(1, 4, frames=300), sample(2, 3, frames=400)]
    assert uids(form_groups(samples, Budget(100, max_audio_frames=1200)).groups) == [[0, 1], [2]]
    assert uids(form_groups(samples, Budget(100, max_audio_frames=1600)).groups) == [[0, 1, 2]]
    assert uids(form_groups(samples, Budget(100, max_audio_frames=1199)).groups) == [[0], [1, 2]]
    both = Budget(100, max_vision_patches=10, max_audio_frames=1600)
    assert uids(form_groups(samples, both).groups) == [[0, 1, 2]]  # no patches: vision cap idle
    with pytest.raises(OverBudgetError, match=r"900 audio frames\) alone, over the token budget "
                                              r"100 / audio cap 800 frames;"):
        form_groups(samples, Budget(100, max_audio_frames=800), over_budget="error")


def test_over_budget_policies():
    samples = [sample(0, 50, index=70), sample(1, 8), sample(2, 60, patches=3, index=72), sample(3, 8)]
    grouping = form_groups(samples, Budget(40))
    assert uids(grouping.groups) == [[2], [0], [1, 3]]
    assert [s.uid for s in grouping.over_budget] == [2, 0]
    with pytest.raises(OverBudgetError, match=r"sample 72 costs 60 tokens \(60 LLM tokens, 3 vision "
                                              r"patches, 0 audio frames\) alone, over the token "
                                              r"budget 40;"):
        form_groups(samples, Budget(40), over_budget="error")
    with pytest.raises(OverBudgetError, match=r"budget 100 / vision cap 2;"):
        form_groups(samples, Budget(100, max_vision_patches=2), over_budget="error")
    with pytest.raises(OverBudgetError, match=r"set ODBConfig.over_budget \(YAML key odb_over_budget\) to 'singleton'"):
        form_groups([sample(0, 41)], Budget(40, pad_to_multiple_of=8), over_budget="error")
    assert form_groups(samples[1::2], Budget(40), over_budget="error").over_budget == []
    with pytest.raises(ValueError, match=r"over_budget must be one of \('singleton', 'error'\), got 'skip'"):
        form_groups(samples, Budget(40), over_budget="skip")


# ------------------------------------------------------------------ target and fitting

def test_target_ignores_ranks_without_data_and_draining_ranks_while_some_stream():
    assert target_groups([RankStatus(0, 0, False), RankStatus(3, 10, False)]) == 3
    assert target_groups([RankStatus(1, 2, True), RankStatus(3, 10, False)]) == 3
    assert target_groups([RankStatus(7, 9, True), RankStatus(3, 10, False)]) == 3
    assert target_groups([RankStatus(2, 2, True), RankStatus(4, 4, True)]) == 4
    assert target_groups([]) == 0


@settings(max_examples=800)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 30), st.booleans()), max_size=8))
def test_target_matches_its_definition(raw):
    statuses = [RankStatus(max(1, g) if b else 0, b, e) for g, b, e in raw]
    target = target_groups(statuses)
    holding = [s for s in statuses if s.buffered]
    if not holding:
        assert target == 0
    elif all(s.exhausted for s in holding):
        # the fewest slots that empty every buffer (each draining rank can split up to buffered)
        assert target == max(s.groups for s in holding)
    else:
        # every streaming rank can emit `target` full groups, and some can emit no more
        streaming = [s.groups for s in holding if not s.exhausted]
        assert all(g >= target for g in streaming) and target in streaming


def test_overflow_keeps_the_fullest_groups_hand_example():
    g = [[sample(0, 10), sample(1, 10), sample(2, 10)],   # cost 30
         [sample(3, 25), sample(4, 25)],                  # 50
         [sample(5, 10)],                                 # 10
         [sample(6, 50)],                                 # 50
         [sample(7, 20), sample(8, 20)]]                  # 40
    fit = fit_to_target(g, 3, Budget(100))
    assert uids(fit.slots) == [[3, 4], [6], [7, 8]]        # the fullest three, in their order
    assert [s.uid for s in fit.recirculated] == [0, 1, 2, 5]
    assert (fit.overflow_groups, fit.splits) == (2, 0)
    fit = fit_to_target(g, 1, Budget(100))                 # ties: the earlier group stays
    assert uids(fit.slots) == [[3, 4]] and fit.overflow_groups == 4
    # the padded cost decides: 20 > 2 * 9 unpadded, but 21 < 2 * 14 rounded to multiples of 7
    g2 = [[sample(0, 20)], [sample(1, 9), sample(2, 9)]]
    assert uids(fit_to_target(g2, 1, Budget(100)).slots) == [[0]]
    assert uids(fit_to_target(g2, 1, Budget(100, pad_to_multiple_of=7)).slots) == [[1, 2]]
    assert uids(fit_to_target(g2, 1, Budget(100, "packed", 7)).slots) == [[0]]


@settings(max_examples=1200)
@given(st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=6), min_size=1, max_size=10),
       st.integers(1, 10), st.sampled_from([1, 8]), st.sampled_from(["padded", "packed"]))
def test_overflow_recirculates_only_groups_no_fuller_than_the_kept(lengths, target, multiple, mode):
    budget = Budget(10**6, mode, multiple)
    uid = itertools.count()
    groups = [[sample(next(uid), l) for l in g] for g in lengths]
    fit = fit_to_target(groups, target, budget)
    if len(groups) <= target:
        assert fit.overflow_groups == 0 and fit.recirculated == []
        return

    def cost(g):  # second formulation of the group cost
        if mode == "packed":
            return sum(s.cost.input_tokens for s in g)
        return len(g) * roundup(max(s.cost.input_tokens for s in g), multiple)

    kept = [groups.index(next(g for g in groups if uids([g]) == uids([slot]))) for slot in fit.slots]
    dropped = [i for i in range(len(groups)) if i not in kept]
    assert kept == sorted(kept) and len(kept) == target and fit.overflow_groups == len(dropped)
    for k in kept:
        for d in dropped:
            assert cost(groups[k]) > cost(groups[d]) or (cost(groups[k]) == cost(groups[d]) and k < d)
    assert [s.uid for s in fit.recirculated] == [s.uid for d in dropped for s in groups[d]]


def test_split_peels_the_shortest_member_of_the_largest_group():
    g = [[sample(0, 9), sample(1, 8), sample(2, 7)], [sample(3, 5), sample(4, 4)]]
    fit = fit_to_target(g, 3, Budget(100))
    assert uids(fit.slots) == [[0, 1], [3, 4], [2]] and fit.splits == 1
    fit = fit_to_target(g, 4, Budget(100))                 # ties between sizes 2: the earlier
    assert uids(fit.slots) == [[0], [3, 4], [2], [1]] and fit.splits == 2
    fit = fit_to_target(g, 7, Budget(100))                 # five samples: two IDLE slots
    assert uids(fit.slots) == [[0], [3], [2], [1], [4], [], []] and fit.splits == 3
    assert fit.recirculated == [] and fit.overflow_groups == 0
    fit = fit_to_target([], 2, Budget(100))
    assert fit.slots == [[], []] and fit.splits == 0


def test_shuffle_permutes_the_slots_reproducibly():
    g = [[sample(i, 10 - i)] for i in range(8)]
    plain = uids(fit_to_target(g, 8, Budget(100)).slots)
    assert plain == [[i] for i in range(8)]
    a = uids(fit_to_target(g, 8, Budget(100), shuffle_seed="7:0:1").slots)
    assert a == uids(fit_to_target(g, 8, Budget(100), shuffle_seed="7:0:1").slots)
    assert sorted(a) == plain and a != plain
    assert a != uids(fit_to_target(g, 8, Budget(100), shuffle_seed="7:0:2").slots)


def test_rank_planner_shuffles_each_rank_and_round_with_its_own_seed():
    """The slot order of round k on rank r is the longest-first grouping shuffled by
    random.Random(f"{seed}:{r}:{k}") (what makes the loader and the simulation agree);
    without a seed the groups keep their longest-first order."""
    import random
    lengths = [95, 90, 85, 80, 75, 70, 65, 60]

    def first_round(rank, seed):
        p = RankPlanner(Budget(100), 8, iter([sample(i, n) for i, n in enumerate(lengths)]),
                        rank=rank, shuffle_seed=seed)
        statuses, costs = _round([p])
        return uids([slot.samples for slot in p.close_round(costs).slots])

    longest_first = [[i] for i in range(8)]            # budget 100: no two samples fit together
    assert first_round(0, None) == longest_first
    for rank in (0, 3):
        expected = list(longest_first)
        random.Random(f"s:e:{rank}:0").shuffle(expected)
        assert first_round(rank, "s:e") == expected
    assert first_round(0, "s:e") != first_round(3, "s:e")


def test_simulated_nonjoin_epoch_is_the_loaders():
    """A second formulation: the real loader (world 1, in process) on the same samples and
    options trains exactly the simulated steps, repeats of the view included."""
    from odb_factory import ODBDataLoader
    from odb_factory.cost import DefaultCost
    from odb_factory.synthetic import LengthDataset, long_tail_lengths
    ds = LengthDataset(long_tail_lengths(30, cv=1.0, mean=40, seed=5, maximum=150))
    costs = [SampleCost(*DefaultCost()(ds[i])) for i in range(len(ds))]
    for join, quota in ((True, None), (False, 75)):
        cfg = ODBConfig(token_budget=160, buffer_size=6, join=join, quota=quota, seed=4)
        sim = simulate_epoch(costs, cfg, 1, epoch=1)
        loader = ODBDataLoader(ds, ODBConfig.from_dict(cfg.to_dict()), collate_fn=lambda batch: None,
                               num_workers=0, num_collate_workers=0)
        loader.set_epoch(1)
        steps = [step.indices for step in loader]
        loader.close()
        assert steps == [[s.index for s in slot.samples] for slot in sim.slots[0]]
        assert join or len([i for step in steps for i in step]) == 75


# ------------------------------------------------------------------ quota

def test_trim_to_quota_hand_examples():
    sizes = [[3, 2], [1, 4]]
    assert trim_to_quota(sizes, 5) == ([[3, 1], [1, 0]], 2)
    assert trim_to_quota(sizes, 4) == ([[3], [1]], 1)       # slot 1 would add nothing
    assert trim_to_quota(sizes, 2) == ([[2], [0]], 1)
    assert trim_to_quota(sizes, 100) == ([[3, 2], [1, 4]], 2)
    assert trim_to_quota(sizes, 0) == ([[], []], 0)
    assert trim_to_quota([[0, 2], [0, 0]], 9) == ([[0, 2], [0, 0]], 2)
    assert trim_to_quota([], 3) == ([], 0)


@settings(max_examples=1500)
@given(st.integers(1, 5).flatmap(lambda t: st.lists(st.lists(st.integers(0, 9), min_size=t, max_size=t),
                                                     min_size=1, max_size=6)),
       st.integers(0, 120))
def test_trim_to_quota_matches_a_running_total(sizes, remaining):
    kept, target = trim_to_quota(sizes, remaining)
    world, slots = len(sizes), len(sizes[0])
    before = 0  # samples of earlier (slot, rank) cells in slot-major order
    expected = [[0] * slots for _ in range(world)]
    for slot in range(slots):
        for rank in range(world):
            expected[rank][slot] = max(0, min(sizes[rank][slot], remaining - before))
            before += sizes[rank][slot]
    used = [s for s in range(slots) if any(expected[r][s] for r in range(world))]
    expected_target = used[-1] + 1 if used else 0
    assert target == expected_target
    assert kept == [row[:expected_target] for row in expected]


# ------------------------------------------------------------------ rounds and stats

def _round(planners):
    statuses = [p.begin_round() for p in planners]
    costs = [p.plan_round(statuses) for p in planners]
    return statuses, costs


def test_rank_planner_round_by_hand():
    # rank 0 streams 6 samples of 10 tokens (budget 20: two per group), buffer 4;
    # rank 1 holds 1 over-budget sample and is exhausted at once.
    p0 = RankPlanner(Budget(20), 4, iter([sample(i, 10, labels=i) for i in range(6)]), rank=0)
    p1 = RankPlanner(Budget(20), 4, iter([sample(0, 25, labels=7, index=9)]), rank=1)
    statuses, costs = _round([p0, p1])
    assert statuses == [RankStatus(2, 4, False), RankStatus(1, 1, True)]
    assert [len(c) for c in costs] == [2, 2]
    r0, r1 = p0.close_round(costs), p1.close_round(costs)
    assert [[s.index for s in slot.samples] for slot in r1.slots] == [[9], []]
    assert (r1.stats.target, r1.stats.idle_slots, r1.stats.over_budget, r1.stats.splits) == (2, 1, 1, 0)
    assert (r0.stats.idle_slots, r0.stats.over_budget, r0.stats.round) == (0, 0, 0)
    # every rank agrees on each step's global figures; labels are the sample ids 0..3 and 7
    labels = [sum(c.label_tokens for rank in costs for c in rank[p]) for p in range(2)]
    assert [s.global_label_tokens for s in r0.slots] == [s.global_label_tokens for s in r1.slots] == labels
    assert sum(labels) == 0 + 1 + 2 + 3 + 7
    assert [s.global_samples for s in r0.slots] == [3, 2]
    assert [s.padded_tokens for s in r0.slots] == [20, 20] and [s.padded_tokens for s in r1.slots] == [25, 0]
    assert [s.position for s in r1.slots] == [0, 1] and r1.slots[1].is_idle
    assert r0.costs == r1.costs == [[list(c) for c in costs[0]], [list(c) for c in costs[1]]]
    # round 2: rank 1 has nothing; rank 0 drains its last two samples
    statuses, costs = _round([p0, p1])
    assert statuses == [RankStatus(1, 2, True), RankStatus(0, 0, True)]
    r0 = p0.close_round(costs)
    assert r0.stats.round == 1 and len(r0.slots) == 1 and r0.slots[0].round == 1
    p1.close_round(costs)
    statuses, costs = _round([p0, p1])
    assert costs == [[], []] and p0.finished and p1.finished
    with pytest.raises(RuntimeError, match="close_round"):
        p0.close_round(costs)


def test_rank_planner_quota_closes_the_epoch():
    stream = itertools.cycle([sample(i, 5) for i in range(3)])
    p = RankPlanner(Budget(10), 4, stream, quota=5)
    statuses, costs = _round([p])
    result = p.close_round(costs)
    assert sum(len(s.samples) for s in result.slots) == 4 and p.quota == 1 and not p.finished
    statuses, costs = _round([p])
    result = p.close_round(costs)
    assert sum(len(s.samples) for s in result.slots) == 1 and len(result.slots) == 1
    assert p.quota == 0 and p.finished and p.buffer == []
    assert result.costs == [[[SampleCost(5, 5)]]]


def test_rank_planner_without_data_finishes_at_once():
    p = RankPlanner(Budget(10), 4, iter(()))
    assert p.begin_round() == RankStatus(0, 0, True)
    assert p.plan_round([RankStatus(0, 0, True)]) == [] and p.finished


def test_the_buffer_fills_to_its_size_and_reads_the_stream_no_further():
    # a stream of exactly one buffer: its end is seen only when the next fill comes up short
    p = RankPlanner(Budget(100), 4, iter([sample(i, 10) for i in range(4)]))
    assert p.begin_round() == RankStatus(1, 4, False)
    p.close_round([p.plan_round([RankStatus(1, 4, False)])])
    assert p.begin_round() == RankStatus(0, 0, True)
    read = []

    def counted():
        for i in range(10):
            read.append(i)
            yield sample(i, 10)

    p = RankPlanner(Budget(20), 4, counted())
    status = p.begin_round()
    assert read == [0, 1, 2, 3] and status == RankStatus(2, 4, False)
    p.close_round([p.plan_round([status])])
    assert p.begin_round() == RankStatus(2, 4, False) and read == list(range(8))


@pytest.mark.parametrize("length, read_after, status_after", [
    (10, 6, RankStatus(4, 4, False)),   # tops up the 2 samples sent back with 2 new ones
    (5, 5, RankStatus(3, 3, True)),     # asks for 2, gets 1: the stream is over
])
def test_a_fill_after_an_overflow_tops_the_buffer_up_to_its_size(length, read_after, status_after):
    read = []

    def counted():
        for i in range(length):
            read.append(i)
            yield sample(i, 20)           # budget 20: one sample a group

    p0 = RankPlanner(Budget(20), 4, iter([sample(i, 10) for i in range(100)]), rank=0)  # 2 groups
    p1 = RankPlanner(Budget(20), 4, counted(), rank=1)                                   # 4 groups
    statuses, costs = _round([p0, p1])
    assert statuses == [RankStatus(2, 4, False), RankStatus(4, 4, False)]
    p0.close_round(costs)
    p1.close_round(costs)
    assert len(p1.buffer) == 2            # T = 2: two of its groups go back to the buffer
    assert p1.begin_round() == status_after and len(read) == read_after


@settings(max_examples=500)
@given(worlds())
def test_round_figures_match_the_slots(case):
    """Round stats and slot figures recounted from the slots and the raw costs."""
    costs, world, views, cfg = case
    sim = simulate_epoch(costs, cfg, world, views=views)
    multiple = cfg.pad_to_multiple_of
    for rank in range(world):
        slots, stats = sim.slots[rank], sim.stats[rank]
        assert [s.round for s in stats] == list(range(len(stats)))
        for st_ in stats:
            in_round = [s for s in slots if s.round == st_.round]
            assert st_.idle_slots == sum(1 for s in in_round if not s.samples)
            assert [s.position for s in in_round] == list(range(len(in_round)))
            if cfg.join:
                assert len(in_round) == st_.target
            else:
                assert len(in_round) <= st_.target
        for slot in slots:
            tokens = [costs[s.index].input_tokens for s in slot.samples]
            if cfg.cost_mode == "packed":
                assert slot.padded_tokens == sum(tokens)
            else:
                assert slot.padded_tokens == len(tokens) * roundup(max(tokens, default=0), multiple)
            assert slot.label_tokens == sum(costs[s.index].label_tokens for s in slot.samples)
            assert slot.input_tokens == sum(tokens)
    for step in range(sim.steps):
        row = [sim.slots[r][step] for r in range(world)]
        indices = [s.index for slot in row for s in slot.samples]
        for slot in row:
            assert slot.global_samples == len(indices)
            assert slot.global_label_tokens == sum(costs[i].label_tokens for i in indices)
    assert sim.trained_indices() == [i for r in range(world) for i in sim.trained_indices(r)]


def test_simulated_epoch_properties():
    costs = [SampleCost(10, 4)] * 5
    sim = simulate_epoch(costs, ODBConfig(token_budget=20, buffer_size=2, shuffle=False), 2)
    assert sim.views == [[0, 2, 4], [1, 3]]
    assert sim.steps == len(sim.slots[0]) == len(sim.slots[1]) and sim.rounds == len(sim.stats[0])
    assert sorted(sim.trained_indices(0)) == [0, 2, 4] and sorted(sim.trained_indices(1)) == [1, 3]
    empty = SimulatedEpoch([], [], [])
    assert (empty.steps, empty.rounds, empty.trained_indices()) == (0, 0, [])


def test_round_bound_and_planned_stream():
    assert round_bound([[1, 2, 3], [4]], True, None) == 4
    assert round_bound([[1, 2, 3], [4]], False, 10) == 11
    assert round_bound([], True, None) == 1
    costs = [SampleCost(i + 1, i) for i in range(5)]
    stream = list(planned_stream([4, 1, 4], costs))
    assert stream == [PlannedSample(0, 4, costs[4]), PlannedSample(1, 1, costs[1]),
                      PlannedSample(2, 4, costs[4])]


def test_nonjoin_quota_above_the_dataset_repeats_samples():
    costs = [SampleCost(5, 5)] * 4
    sim = simulate_epoch(costs, ODBConfig(token_budget=10, join=False, quota=11, buffer_size=3), 2)
    trained = sim.trained_indices()
    assert len(trained) == 11 and set(trained) == {0, 1, 2, 3}


# ------------------------------------------------------------------ views

@settings(max_examples=600)
@given(st.integers(0, 60), st.integers(1, 9), st.integers(0, 3), st.integers(0, 3), st.booleans())
def test_views_deal_a_permutation(n, world, seed, epoch, shuffle):
    views = [epoch_view(n, world, r, seed, epoch, shuffle) for r in range(world)]
    assert sorted(i for v in views for i in v) == list(range(n))
    assert [len(v) for v in views] == [len(range(r, n, world)) for r in range(world)]
    if not shuffle:
        assert views == [list(range(r, n, world)) for r in range(world)]
    assert views == [epoch_view(n, world, r, seed, epoch, shuffle) for r in range(world)]


def test_views_change_with_seed_and_epoch():
    base = epoch_view(50, 1, 0, 0, 0)
    assert base != list(range(50))
    assert base != epoch_view(50, 1, 0, 0, 1) and base != epoch_view(50, 1, 0, 1, 0)


def test_cycling_view_repeats_reshuffled_views():
    view = [3, 1, 4, 5, 9]
    stream = cycling_view(view, 0, 0, 0)
    first = [next(stream) for _ in range(5 * 4)]
    assert first[:5] == view
    cycles = [first[5 * k:5 * k + 5] for k in range(1, 4)]
    assert all(sorted(c) == sorted(view) for c in cycles)
    assert any(c != view for c in cycles) and cycles[0] != cycles[1]
    other_rank = cycling_view(view, 0, 0, 1)
    assert [next(other_rank) for _ in range(20)][5:] != first[5:]
    assert list(cycling_view([], 0, 0, 0)) == []


# ------------------------------------------------------------------ samples mode (optimizer_steps)

def test_standard_weights_by_hand():
    from odb_factory.planning.optimizer_steps import (MICRO_MEAN, TOKEN_MEAN, StandardStep,
                                                      sample_weights, weights_by_uid)
    step = StandardStep(((4, 7), (1,), (9, 2)))
    tokens = [3, 5, 0, 6, 2]                       # micro-batches hold 8, 0 and 8 tokens
    assert step.indices == [4, 7, 1, 9, 2]
    assert sample_weights(step, tokens, MICRO_MEAN, 2, 99) == [1 / 24, 1 / 24, 0.0, 1 / 24, 1 / 24]
    assert sample_weights(step, tokens, TOKEN_MEAN, 4, 40) == [0.1] * 5
    assert sample_weights(step, tokens, TOKEN_MEAN, 4, 0) == [0.0] * 5
    with pytest.raises(ValueError, match=r"^unknown Standard loss normalization 'mean'$"):
        sample_weights(step, tokens, "mean", 1, 16)
    samples = [sample(10, 5), sample(11, 6)]
    assert weights_by_uid(samples, [0.5, 0.25]) == {10: 0.5, 11: 0.25}


def test_fixed_batch_steps_shuffle_by_default():
    from odb_factory.planning.optimizer_steps import fixed_batch_steps
    default = fixed_batch_steps(40, 1, 0, 4, 2, seed=3, epoch=0)
    assert default == fixed_batch_steps(40, 1, 0, 4, 2, seed=3, epoch=0, shuffle=True)
    plain = fixed_batch_steps(40, 1, 0, 4, 2, seed=3, epoch=0, shuffle=False)
    assert plain[0].micro_batches == ((0, 1, 2, 3), (4, 5, 6, 7)) and default != plain


def test_pack_and_align_step_guards():
    from odb_factory.planning.optimizer_steps import align_step, pack_step
    with pytest.raises(OverBudgetError, match="sample 5 costs 50 tokens"):
        pack_step([sample(5, 50)], Budget(40), "error")
    assert uids(pack_step([sample(5, 50)], Budget(40), "singleton")) == [[5]]
    groups = [[sample(0, 5)], [sample(1, 5)]]
    assert uids(align_step(groups, [2, 3], Budget(10))) == [[0], [1], []]
    with pytest.raises(AssertionError, match="^a rank holds more groups than the step's target$"):
        align_step(groups, [1], Budget(10))


def test_simulate_epoch_defaults_to_epoch_zero_views_and_the_configs_policy():
    costs = [SampleCost(5, 5)] * 30
    cfg = ODBConfig(token_budget=20, buffer_size=4, seed=2)
    sim = simulate_epoch(costs, cfg, 3)
    assert sim.views == [epoch_view(30, 3, r, 2, 0, True) for r in range(3)]
    assert simulate_epoch(costs, cfg, 3, epoch=1).views == [epoch_view(30, 3, r, 2, 1, True) for r in range(3)]
    with pytest.raises(OverBudgetError, match="sample 1 costs 50 tokens"):
        simulate_epoch([SampleCost(5, 5), SampleCost(50, 5)], ODBConfig(token_budget=20, over_budget="error"), 1)


def test_close_round_needs_a_planned_round():
    p = RankPlanner(Budget(10), 4, iter([sample(0, 5)]))
    p.begin_round()
    with pytest.raises(RuntimeError, match=r"^close_round\(\) follows a plan_round\(\) that did not finish"):
        p.close_round([[]])  # not finished, but nothing planned yet
