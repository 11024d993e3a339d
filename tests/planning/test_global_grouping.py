"""Global grouping (planning/global_grouping.py) over simulated worlds of 1-16 ranks: a
round's re-layout is a permutation of its samples into the fewest T'×W slots (T' <= T) that
hold them within the budget, no group over the budget but over-budget singletons, no step idle
on every rank, never a worse maximal group cost (padded) than the aligned layout when it keeps
its T steps; whole epochs keep every guarantee of the protocol."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from odb_factory import ODBConfig, SampleCost
from odb_factory.balance.cost_model import QWEN3_VL_LLM, VISION_BY_PATCH_TOTAL
from odb_factory.planning.global_grouping import apply_layout, regroup_round, regroup_slots
from odb_factory.planning.grouping import Budget, PlannedSample
from odb_factory.planning.rounds import Slot
from odb_factory.planning.simulated_world import simulate_epoch
from tests.planning.test_protocol_properties import worlds


@st.composite
def rounds(draw):
    """An aligned round: every rank the same number of slots, every step non-empty on some rank."""
    world = draw(st.integers(1, 16))
    slots = draw(st.integers(1, 6))
    budget = Budget(draw(st.sampled_from([64, 512, 4096])), draw(st.sampled_from(["padded", "packed"])),
                    draw(st.sampled_from([1, 8])))
    lengths = st.one_of(st.integers(1, 600), st.integers(1, 20), st.integers(3000, 9000))
    costs = []
    for _ in range(world):
        rank = []
        for _ in range(slots):
            n = draw(st.integers(0, 5))
            drawn = draw(st.lists(lengths, min_size=n, max_size=n))
            rank.append([SampleCost(l, draw(st.integers(0, l))) for l in drawn])
        costs.append(rank)
    for p in range(slots):  # alignment never plans a step idle everywhere
        if not any(costs[r][p] for r in range(world)):
            costs[0][p] = [SampleCost(draw(st.integers(1, 600)), 1)]
    return costs, budget, draw(st.integers(1, 8))


def _max_group_time(groups, budget):
    worst = 0.0
    for g in groups:
        if len(g) > 1 or (g and budget.fits([PlannedSample(0, 0, c) for c in g])):
            if budget.cost_mode == "padded":
                longest = max(budget.padded_length(c.input_tokens) for c in g)
                worst = max(worst, len(g) * float(QWEN3_VL_LLM(float(longest))))
    return worst


def _sparse_round(lengths):
    """Rank 0 holds one slot per entry of `lengths` (a list of lengths each), rank 1 holds none:
    fewer non-empty groups than steps once the short samples are grouped together."""
    return [[[SampleCost(l, 1) for l in slot] for slot in lengths], [[] for _ in lengths]]


@settings(max_examples=200)
@given(rounds())
@example((_sparse_round([[1000], [10], [10]]), Budget(4096), 1))
@example((_sparse_round([[3000], [100, 100], [100], [50]]), Budget(4096), 1))
def test_a_regrouped_round_is_a_permutation_into_the_same_slots(case):
    costs, budget, ranks_per_node = case
    world, slots = len(costs), len(costs[0])
    layout = regroup_round(costs, budget, ranks_per_node, seed="s")
    if layout is None:
        return
    steps = len(layout[0])
    assert len(layout) == world and all(len(rank) == steps for rank in layout)
    assert 1 <= steps <= slots
    if budget.cost_mode == "padded":
        assert steps == min(slots, max(1, -(-_fewest_padded_groups(costs, budget) // world)))
    else:
        _assert_fewest_packed_steps(costs, budget, world, steps)
    sources = sorted(src for rank in layout for slot in rank for src in slot)
    assert sources == sorted((r, p, i) for r in range(world) for p in range(slots) for i in range(len(costs[r][p])))
    regrouped = apply_layout(layout, costs)
    for p in range(steps):
        assert any(regrouped[r][p] for r in range(world)), "a step idle on every rank"
    for rank in regrouped:
        for group in rank:
            if len(group) > 1:
                assert budget.fits([PlannedSample(k, 0, c) for k, c in enumerate(group)])
    if budget.cost_mode == "padded" and steps == slots:
        before = _max_group_time([g for rank in costs for g in rank], budget)
        after = _max_group_time([g for rank in regrouped for g in rank], budget)
        assert after <= before * (1 + 1e-12)


def _fewest_padded_groups(costs, budget):
    """Groups of n * longest <= budget (padded lengths) no partition can do with fewer of: cut
    longest first, each group as many samples as fit beside its longest."""
    lengths = sorted((budget.padded_length(c.input_tokens) for rank in costs for slot in rank for c in slot),
                     reverse=True)
    groups = 0
    while lengths:
        del lengths[:max(1, budget.token_budget // lengths[0])]
        groups += 1
    return groups


def _assert_fewest_packed_steps(costs, budget, world, steps):
    """A packed layout of T' steps: no fewer steps hold the round's tokens, or neither LPT nor
    best fit could fill T' - 1 steps' groups."""
    import numpy as np
    from odb_factory.planning.global_grouping import _beside_alone, _packed
    tokens = np.array([c.input_tokens for rank in costs for slot in rank for c in slot], dtype=np.float64)
    patches = np.array([c.vision_patches for rank in costs for slot in rank for c in slot], dtype=np.float64)
    vision = np.asarray(VISION_BY_PATCH_TOTAL(patches), dtype=np.float64)
    alone = int(np.sum(tokens > budget.token_budget))
    rest = np.flatnonzero(tokens <= budget.token_budget)
    assert steps * world * budget.token_budget >= tokens[rest].sum() and steps * world >= alone + (rest.size > 0)
    fewer = world * (steps - 1) - alone
    if steps > 1 and fewer >= 1 and rest.size:
        head_start = _beside_alone(np.flatnonzero(tokens > budget.token_budget), tokens, vision, world, fewer,
                                   QWEN3_VL_LLM)
        assert _packed(rest, tokens, vision, fewer, budget, QWEN3_VL_LLM, head_start) is None, \
            f"{steps - 1} steps would do"


@settings(max_examples=120)
@given(worlds())
def test_global_grouping_keeps_the_protocol_guarantees_and_the_step_count(case):
    """The same steps on every rank, no more than without global grouping (a round whose
    samples fit fewer steps takes fewer)."""
    costs, world, views, cfg = case
    cfg = dataclasses.replace(cfg, max_vision_patches=None)
    plain = simulate_epoch(costs, cfg, world, views=views)
    sim = simulate_epoch(costs, dataclasses.replace(cfg, global_grouping=True), world, views=views)
    assert len({len(s) for s in sim.slots}) == 1, "the same steps on every rank"
    assert sim.steps <= plain.steps
    assert sorted(sim.trained_indices()) == sorted(plain.trained_indices()), "the same samples"
    budget = Budget.from_config(cfg)
    for step in range(sim.steps):
        row = [sim.slots[r][step] for r in range(world)]
        assert any(not s.is_idle for s in row)
        assert len({s.global_label_tokens for s in row}) == 1
        assert row[0].global_label_tokens == sum(s.label_tokens for s in row)
        assert row[0].global_samples == sum(len(s.samples) for s in row)
        for slot in row:
            if len(slot.samples) > 1:
                assert budget.fits(slot.samples)


@settings(max_examples=80)
@given(worlds(), st.integers(0, 2))
@example(case=([SampleCost(n, n) for n in (40, 40, 5, 20, 60, 40, 40, 20, 40, 20)], 2, None,   # two
               ODBConfig(token_budget=64, buffer_size=8)), epoch=0)                        # ranks regroup
def test_the_simulated_epoch_lays_out_each_aligned_round_as_regroup_round_does(case, epoch):
    """simulate_epoch with global grouping, re-derived round by round from the plain epoch:
    each round's slots are regroup_round's layout of that round (the world's node size, the
    seed of the epoch and round), with each slot's round, position, padded tokens and the
    step's global figures recomputed from the samples it received."""
    costs, world, views, cfg = case
    cfg = dataclasses.replace(cfg, max_vision_patches=None)
    plain = simulate_epoch(costs, cfg, world, epoch=epoch, views=views)
    sim = simulate_epoch(costs, dataclasses.replace(cfg, global_grouping=True), world, epoch=epoch,
                         views=views)
    budget = Budget.from_config(cfg)
    if world == 1:  # one rank has no peers to regroup with
        assert sim.slots == plain.slots
        return
    start = at = 0
    while start < plain.steps:
        number = plain.slots[0][start].round
        end = start
        while end < plain.steps and plain.slots[0][end].round == number:
            end += 1
        aligned = [[slot.samples for slot in rank[start:end]] for rank in plain.slots]
        layout = regroup_round([[[s.cost for s in g] for g in rank] for rank in aligned], budget,
                               cfg.ranks_per_node or world, seed=f"{cfg.seed}:{epoch}:{number}")
        want = aligned if layout is None else apply_layout(layout, aligned)
        for q in range(len(want[0])):
            step = [s for rank in want for s in rank[q]]
            for r in range(world):
                got = sim.slots[r][at + q]
                assert [s.uid for s in got.samples] == [s.uid for s in want[r][q]]
                assert (got.round, got.position) == (number, plain.slots[r][start + q].position)
                assert got.padded_tokens == budget.group_cost(list(want[r][q]))
                assert got.global_label_tokens == sum(s.cost.label_tokens for s in step)
                assert got.global_samples == len(step)
        start, at = end, at + len(want[0])
    assert at == sim.steps


def _lpt_with_room(rest, tokens, vision, bins, budget, cost_model):
    """LPT by a linear scan: costliest first (ties: earlier first; cost = the LLM's plus the
    vision tower's) onto the least-loaded group (ties: lowest) whose room still holds the
    sample's tokens; None when none does."""
    cost = [float(cost_model(float(tokens[k]))) + float(vision[k]) for k in rest]
    order = sorted(range(len(rest)), key=lambda j: (-cost[j], j))
    load, room = [0.0] * bins, [float(budget.token_budget)] * bins
    groups = [[] for _ in range(bins)]
    for j in order:
        open_bins = [b for b in range(bins) if room[b] >= tokens[rest[j]]]
        if not open_bins:
            return None
        b = min(open_bins, key=lambda b: (load[b], b))
        groups[b].append(int(rest[j]))
        load[b] += cost[j]
        room[b] -= tokens[rest[j]]
    return groups


def _best_fit_by_scan(rest, tokens, bins, budget):
    """The rooms best-fit decreasing leaves, by a linear scan: longest first into the group with
    the least room that still holds it (which of equal rooms does not change the rooms left)."""
    room = [float(budget.token_budget)] * bins
    for k in sorted(rest.tolist(), key=lambda k: (-tokens[k], k)):
        fits = [b for b in range(bins) if room[b] >= tokens[k]]
        if not fits:
            return None
        room[min(fits, key=lambda b: room[b])] -= tokens[k]
    return sorted(room)


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from([1, 7, 8, 16, 50, 64, 100, 128]), st.sampled_from([0, 0, 16, 4096])),
                min_size=1, max_size=40),
       st.integers(1, 8), st.sampled_from([64, 128, 256]))
@example([(n, 0) for n in (7926, 3206, 2317, 827, 5563, 1869, 720, 1721)], 3, 8192)
@example([(n, 0) for n in (50, 50, 40, 30, 30)], 2, 100)
@example([(10, 0), (10, 4096), (10, 0)], 2, 64)
def test_packed_regrouping_is_lpt_or_else_best_fit_under_the_token_budget(samples, bins, budget_tokens):
    """The packed layout's groups: LPT written as a linear scan (lengths repeat, so ties in
    cost and exact fits of a group's room happen) where it places every sample, else best-fit
    decreasing, which places them wherever any greedy does. In the first explicit example the
    least-loaded group lacks the room for a sample another group has (long samples cost more a
    token), so groups are passed over and must stay candidates; in the second LPT deals the 50s
    to both groups of 100 and strands the last 30, which best fit places (50+50 | 40+30+30).
    In the third the sample with 4096 patches is the costliest and gets a group to itself."""
    import numpy as np
    from odb_factory.planning.global_grouping import _packed
    budget = Budget(budget_tokens, "packed")
    tokens = np.array([n for n, _ in samples], dtype=np.float64)
    vision = np.array([float(VISION_BY_PATCH_TOTAL(v)) for _, v in samples])
    rest = np.arange(len(samples), dtype=np.int64)
    lpt = _lpt_with_room(rest, tokens, vision, bins, budget, QWEN3_VL_LLM)
    got = _packed(rest, tokens, vision, bins, budget, QWEN3_VL_LLM)
    if samples == [(10, 0), (10, 4096), (10, 0)]:
        assert sorted(map(sorted, got)) == [[0, 2], [1]]
    if lpt is not None:
        assert got == lpt
        return
    room = _best_fit_by_scan(rest, tokens, bins, budget)
    if room is None:
        assert got is None
        return
    assert sorted(i for g in got for i in g) == rest.tolist()
    assert sorted(budget.token_budget - tokens[g].sum() for g in got) == room


def test_regroup_round_edge_cases_by_hand():
    big = Budget(4096)
    assert regroup_round([], big) is None                                   # no rank
    assert regroup_round([[[SampleCost(10, 1)], []]], big) is None          # fewer samples than steps
    with pytest.raises(ValueError) as raised:
        regroup_round([[[SampleCost(10, 1)]], [[SampleCost(10, 1)], []]], big)
    assert str(raised.value) == "regroup_round: ranks hold different slot counts [1, 2]"
    # as many samples as steps, one sample, one over-budget sample: each still gets its layout
    assert regroup_round([[[SampleCost(10, 1)], [SampleCost(20, 1)]]], big) is not None
    assert regroup_round([[[SampleCost(10, 1)]]], big) == [[[(0, 0, 0)]]]
    assert regroup_round([[[SampleCost(5000, 1)]]], big) == [[[(0, 0, 0)]]]
    # packed: 9 + 7 tokens fill a 16-token budget exactly (padded to 8 they would not)
    assert regroup_round([[[SampleCost(9, 1), SampleCost(7, 1)]]], Budget(16, "packed", 8)) is not None


def test_a_round_regroup_round_cannot_lay_out_keeps_its_slots():
    """{7, 3} | {6, 2, 2} | {5, 3, 2} fill three 10-token packed groups, but LPT (7, 6, 5, then
    3, 3 beside the 5 and the 6) and best fit (7+3, 6+3, 5+2+2, then no room for the last 2)
    both strand a sample: regroup_round gives None, and the round stays as it was."""
    budget = Budget(10, "packed", 1)
    samples = [PlannedSample(f"u{k}", k, SampleCost(n, 1)) for k, n in enumerate([7, 3, 6, 2, 2, 5, 3, 2])]
    slots = [[Slot(tuple(samples[:2]), 3, 0, 2, 2, 10), Slot(tuple(samples[2:5]), 3, 1, 3, 3, 10),
              Slot(tuple(samples[5:]), 3, 2, 3, 3, 10)]]
    assert regroup_round([[[s.cost for s in slot.samples] for slot in slots[0]]], budget) is None
    assert regroup_slots(slots, budget, 1, seed="s") == slots


def test_regroup_round_keeps_the_encoder_caps():
    """The neighbouring-length partition {A, C} | {B, D} is taken unless it breaks the vision
    cap; a lone sample over the cap (trained alone anyway) does not veto a layout."""
    def s(tokens, patches):
        return SampleCost(tokens, 1, patches)
    capped = Budget(4096, max_vision_patches=100)
    within = [[[s(1000, 60), s(10, 0)]], [[s(1000, 0), s(10, 60)]]]
    regrouped = apply_layout(regroup_round(within, capped, seed=None), within)
    assert sorted([c.input_tokens for c in regrouped[r][0]] for r in range(2)) == [[10, 10], [1000, 1000]]
    over = [[[s(1000, 60), s(10, 0)]], [[s(1000, 60), s(10, 0)]]]
    assert regroup_round(over, capped, seed=None) is None               # {A, C} holds 120 patches
    assert regroup_round(over, Budget(4096), seed=None) is not None
    # packed LPT deals four samples into four groups: the 150-patch sample stays alone
    lone = [[[s(10, 150)], [s(1000, 0)]], [[s(10, 0)], [s(1000, 0)]]]
    assert regroup_round(lone, dataclasses.replace(capped, cost_mode="packed"), seed=None) is not None


def test_a_thin_round_takes_the_fewest_steps_its_groups_need():
    """Samples 0-4 of 3000, 100, 100, 100 and 50 tokens in 4 aligned steps of a 4096-token padded
    budget: the longest-first cut needs two groups ({0} and the four short ones together), which
    two ranks train in one step. Rank 0 holds every byte, so the costlier group stays there."""
    costs = _sparse_round([[3000], [100, 100], [100], [50]])
    layout = regroup_round(costs, Budget(4096), seed=None)
    assert layout == [[[(0, 0, 0)]], [[(0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 3, 0)]]]


@pytest.mark.parametrize("first, second, budget", [
    # padded: two rows of 1000 cost more than one of 1500 (by token sums the other way round)
    ([1500], [1000, 10], Budget(4096)),
    # packed: LPT puts 10 tokens in one group and 6 + 5 in the other, which cost more together
    # (21 tokens need both steps of an 11-token budget)
    ([10], [6, 5], Budget(11, "packed", 1)),
])
def test_steps_go_costliest_first_by_the_budgets_group_cost(first, second, budget):
    """Without a seed the costlier group, the second slot's, becomes the first step."""
    costs = [[[SampleCost(l, 1) for l in first], [SampleCost(l, 1) for l in second]]]
    assert regroup_round(costs, budget, seed=None) == [[[(0, 1, 0), (0, 1, 1)], [(0, 0, 0)]]]


def test_a_seed_shuffles_the_rounds_steps():
    costs = [[[SampleCost(l, 1)] for l in (4000, 3000, 2000, 1000)], [[SampleCost(l, 1)] for l in (3500, 2500, 1500, 500)]]
    longest_first = regroup_round(costs, Budget(4096), seed=None)
    assert any(regroup_round(costs, Budget(4096), seed=str(k)) != longest_first for k in range(10))


def test_a_round_of_unrelated_lengths_gets_steps_of_neighbouring_lengths():
    """Two ranks, two steps: each rank holds one long and one short group; regrouped, one step
    holds both long samples and the other both short ones, and the slowest rank of each step
    costs less in total (the straggler gone)."""
    long, short = SampleCost(4000, 10), SampleCost(100, 10)
    costs = [[[long], [short] * 4], [[short] * 4, [long]]]
    layout = regroup_round(costs, Budget(4096), seed=None)
    regrouped = apply_layout(layout, costs)
    lengths = [sorted({c.input_tokens for r in range(2) for c in regrouped[r][p]}) for p in range(2)]
    assert sorted(lengths) == [[100], [4000]]

    def step_time(layout_costs):
        return sum(max(len(g) * float(QWEN3_VL_LLM(float(max((c.input_tokens for c in g), default=0))))
                       for g in (layout_costs[r][p] for r in range(2))) for p in range(2))
    assert step_time(regrouped) < 0.8 * step_time(costs)
    # each long sample stayed where it was (placement keeps bytes on their rank)
    assert layout[0][[p for p in range(2) if regrouped[0][p] and regrouped[0][p][0] is long][0]][0] == (0, 0, 0)


def test_a_packed_round_takes_the_fewest_steps_its_tokens_allow():
    """Two ranks, three aligned steps of 100-token samples (a rank's tail left them thin):
    600 tokens fit one step of two 512-token groups, packed or padded."""
    costs = [[[SampleCost(100, 1)] for _ in range(3)], [[SampleCost(100, 1)] for _ in range(3)]]
    for budget in (Budget(512, "packed", 1), Budget(512)):
        layout = regroup_round(costs, budget, seed=None)
        assert [len(rank) for rank in layout] == [1, 1]
        assert sorted(len(rank[0]) for rank in layout) == [3, 3]
    # 700 tokens do not fit two 300-token groups: two steps, not one
    tight = [[[SampleCost(100, 1)] for _ in range(4)], [[SampleCost(100, 1)] for _ in range(3)] + [[]]]
    assert [len(rank) for rank in regroup_round(tight, Budget(300, "packed", 1), seed=None)] == [2, 2]


def test_the_groups_beside_an_over_budget_sample_fill_up_to_it_first():
    """Two ranks, a 100-token packed budget, one 150-token sample (over budget, alone) and eight
    of 20 tokens: two steps. The step of the 150-token sample waits for it anyway, so the rank
    beside it takes a full group (5 x 20) and the other step the rest (40 | 20): 150 + 40 token
    times instead of 150 + 60 with three even groups."""
    a, b = SampleCost(150, 1), SampleCost(20, 1)
    costs = [[[a], [b, b], [b, b]], [[b, b], [b], [b]]]
    layout = regroup_round(costs, Budget(100, "packed", 1), seed=None)
    tokens = [[sum(costs[r][p][i].input_tokens for r, p, i in slot) for slot in rank] for rank in layout]
    assert sorted(map(sorted, zip(*tokens))) == [[20, 40], [100, 150]]
