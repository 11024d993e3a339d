"""StepRebalancer: the layout every rank computes from the gathered costs (in one process),
and the re-dealt step on 2-3 real gloo ranks: every sample lands exactly once, with its
payload, and the step's largest rank cost goes down."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odb_factory import SampleCost
from odb_factory.balance import StageCostModel
from odb_factory.balance.step_plan import StepBalance
from odb_factory.comm import SyncChannel
from odb_factory.loader.step_rebalancer import StepRebalancer
from odb_factory.planning.grouping import Budget
from tests.helpers.distributed import run_world

IDENTITY = StageCostModel(0.0, 1.0, 0.0)   # a sample's cost is its (padded) length


def spec(mode, ranks_per_node=1):
    return StepBalance(mode=mode, ranks_per_node=ranks_per_node, cost_model=IDENTITY, vision_cost_model=None)


def rank_cost(mode, tokens):
    """What the balancer equalises on one rank (IDENTITY model, no padding multiple)."""
    if not tokens:
        return 0
    return len(tokens) * max(tokens) if mode == "padded" else sum(tokens)


def local(world, **kwargs):
    return StepRebalancer(SyncChannel(None, 0, world, 5.0), budget=kwargs.pop("budget", Budget(10**6)),
                          **kwargs)


# ------------------------------------------------------------------ the plan (pure, one process)

def test_node_of_groups_consecutive_ranks():
    r = local(5, spec=None, ranks_per_node=2)
    assert [r.node_of(k) for k in range(5)] == [0, 0, 1, 1, 2]
    assert [local(3, spec=None).node_of(k) for k in range(3)] == [0, 1, 2]   # default: a node per rank


def test_without_balancing_or_regrouping_the_layout_is_the_aligned_one():
    costs = [[[SampleCost(10, 5)], []], [[SampleCost(30, 1), SampleCost(7, 7)], [SampleCost(2, 2)]]]
    layout, metrics = local(2, spec=None).plan(costs, round_no=0, epoch=0)
    assert layout == [[[(0, 0, 0)], []], [[(1, 0, 0), (1, 0, 1)], [(1, 1, 0)]]]
    assert set(metrics) == {"balance_planning_s"}


def test_an_uneven_step_is_re_dealt_by_hand():
    # step 0: rank 0 holds 30+20+10, rank 1 nothing -> {30} | {20, 10}; step 1 is already even
    c = SampleCost
    costs = [[[c(30, 3), c(20, 2), c(10, 1)], [c(5, 5)]], [[], [c(5, 5)]]]
    layout, metrics = local(2, spec=spec("lpt")).plan(costs, round_no=0, epoch=0)
    step0 = sorted(sorted(costs[src][p][pos].input_tokens for src, p, pos in layout[r][0]) for r in range(2))
    assert step0 == [[10, 20], [30]]
    assert [layout[r][1] for r in range(2)] == [[(0, 1, 0)], [(1, 1, 0)]]   # nothing to gain: stays
    # step 0: 60 on one rank over a lower bound of 30; step 1 already at its bound: mean (2 + 1) / 2
    assert metrics["balance_max_over_lb_before"] == 1.5
    assert metrics["balance_max_over_lb"] == 1.0
    assert metrics["balance_unbalanced_steps"] == 0.0
    assert 0.0 <= metrics["balance_planning_s"] < 60.0


def test_samples_of_zero_cost_report_ratios_of_one():
    """A step whose samples cost nothing has a lower bound of 0: the ratios read 1.0."""
    layout, metrics = local(2, spec=spec("lpt")).plan([[[SampleCost(0, 0)]], [[]]], round_no=0, epoch=0)
    assert sorted(src for rank in layout for src in rank[0]) == [(0, 0, 0)]
    assert (metrics["balance_max_over_lb_before"], metrics["balance_max_over_lb"]) == (1.0, 1.0)


def test_a_round_with_no_step_to_balance_reports_ratios_of_one():
    """No balanced step: the logged max/lower-bound ratios read 1.0 (nothing over the bound)."""
    layout, metrics = local(2, spec=spec("lpt")).plan([[[]], [[]]], round_no=0, epoch=0)
    assert layout == [[[]], [[]]]
    assert (metrics["balance_max_over_lb_before"], metrics["balance_max_over_lb"],
            metrics["balance_unbalanced_steps"]) == (1.0, 1.0, 1.0)


tokens_st = st.integers(1, 300)
round_st = st.integers(2, 4).flatmap(lambda world: st.integers(1, 3).flatmap(lambda slots: st.lists(
    st.lists(st.lists(tokens_st, max_size=4), min_size=slots, max_size=slots), min_size=world, max_size=world)))


@given(lengths=round_st, mode=st.sampled_from(["padded", "lpt", "min_move"]), ranks_per_node=st.integers(1, 2))
def test_balancing_re_deals_each_step_keeping_every_sample_once(lengths, mode, ranks_per_node):
    costs = [[[SampleCost(t, t // 2) for t in slot] for slot in rank] for rank in lengths]
    world, slots = len(costs), len(costs[0])
    layout, metrics = local(world, spec=spec(mode, ranks_per_node)).plan(costs, round_no=3, epoch=1)
    assert len(layout) == world and all(len(rank) == slots for rank in layout)
    for p in range(slots):
        column = sorted(src for r in range(world) for src in layout[r][p])
        # a sample stays in its step (the step's gradient is unchanged), on exactly one rank
        assert column == sorted((r, p, i) for r in range(world) for i in range(len(costs[r][p])))
    assert metrics["balance_max_over_lb"] >= 1.0 - 1e-9
    assert 0 <= metrics["balance_unbalanced_steps"] <= slots


@given(lengths=round_st, ranks_per_node=st.integers(1, 2))
def test_global_grouping_keeps_every_sample_once_in_no_more_steps(lengths, ranks_per_node):
    costs = [[[SampleCost(t, t) for t in slot] for slot in rank] for rank in lengths]
    world, slots = len(costs), len(costs[0])
    rebalancer = local(world, spec=None, global_grouping=True, budget=Budget(400), seed="7",
                       ranks_per_node=ranks_per_node)
    layout, metrics = rebalancer.plan(costs, round_no=2, epoch=0)
    assert len({len(rank) for rank in layout}) == 1 and len(layout[0]) <= slots
    every = sorted(src for rank in layout for slot in rank for src in slot)
    assert every == sorted((r, p, i) for r in range(world) for p in range(slots) for i in range(len(costs[r][p])))
    assert metrics["global_grouping_rounds"] in (0.0, 1.0)
    again, _ = rebalancer.plan(costs, round_no=2, epoch=0)
    assert again == layout   # every rank computes the same layout from the same costs


# ------------------------------------------------------------------ real gloo ranks

def round_of(world):
    """tokens[rank][slot]: an uneven round, rank 0 heavy in slot 0, the last rank in slot 1."""
    heavy, light = [300, 280, 260, 40], [20]
    return [[heavy if r == 0 else light, heavy if r == world - 1 else [30, 10]] for r in range(world)]


def indices_of(world):
    """A dataset index for every sample of the round, unique over ranks."""
    out, n = [], 0
    for rank in round_of(world):
        out.append([])
        for slot in rank:
            out[-1].append(list(range(n, n + len(slot))))
            n += len(slot)
    return out


def _rebalance_rank(rank, world, mode, ranks_per_node):
    from odb_factory import SampleCost
    from odb_factory.comm import SyncChannel
    from odb_factory.loader.step_rebalancer import StepRebalancer
    from odb_factory.planning.grouping import Budget, PlannedSample
    from odb_factory.planning.rounds import Slot
    tokens, indices = round_of(world), indices_of(world)
    costs = [[[SampleCost(t, t // 2) for t in slot] for slot in r] for r in tokens]   # as gathered
    budget = Budget(10**6, "padded" if mode == "padded" else "packed")
    payloads, slots = {}, []
    for p, (slot_tokens, slot_indices) in enumerate(zip(tokens[rank], indices[rank])):
        samples = []
        for t, index in zip(slot_tokens, slot_indices):
            uid = len(payloads)
            payloads[uid] = {"index": index, "born_on": rank}
            samples.append(PlannedSample(uid, index, SampleCost(t, t // 2)))
        slots.append(Slot(tuple(samples), 4, p, 777, 55, budget.group_cost(samples)))
    channel = SyncChannel.create(30.0)
    exchanges, gather = [], channel.all_gather

    def recorded(obj, what, epoch=-1, round=-1):
        exchanges.append((what, epoch, round))
        return gather(obj, what, epoch, round)
    channel.all_gather = recorded
    rebalancer = StepRebalancer(channel, spec(mode, ranks_per_node), budget, ranks_per_node=ranks_per_node)

    def summary(moved):
        return {"slots": [([(s.uid, s.index, s.cost.input_tokens) for s in slot.samples], slot.round,
                           slot.position, slot.global_label_tokens, slot.global_samples, slot.padded_tokens)
                          for slot in moved.slots],
                "sent": moved.sent_uids, "received": moved.received, "metrics": moved.metrics}
    recounted = summary(rebalancer.rebalance(slots, costs, payloads.__getitem__, epoch=1))
    kept = summary(rebalancer.rebalance(slots, costs, payloads.__getitem__, epoch=1, step_totals=True))
    return {"before": [[(s.uid, s.index) for s in slot.samples] for slot in slots],
            "recounted": recounted, "kept": kept, "exchanges": exchanges}


@pytest.mark.slow
@pytest.mark.parametrize("world,mode,ranks_per_node", [(2, "padded", 2), (3, "lpt", 1), (3, "min_move", 3)])
def test_rebalanced_step_keeps_every_sample_once_and_lowers_the_max_rank_cost(world, mode, ranks_per_node):
    results = run_world(_rebalance_rank, world, mode, ranks_per_node, timeout=60)
    tokens, indices = round_of(world), indices_of(world)
    token_of = {i: t for r in range(world) for p in range(2) for i, t in zip(indices[r][p], tokens[r][p])}
    for key in ("recounted", "kept"):
        sent = received = 0
        for p in range(2):
            after = [r[key]["slots"][p] for r in results]
            assert all(a[1:3] == (4, p) for a in after)   # round and position kept
            got = sorted(index for a in after for _, index, _ in a[0])
            assert got == sorted(i for r in range(world) for i in indices[r][p]), "lost or duplicated a sample"
            column = [[token_of[index] for _, index, _ in a[0]] for a in after]
            before = max(rank_cost(mode, tokens[r][p]) for r in range(world))
            assert max(rank_cost(mode, c) for c in column) < before, f"step {p} was not evened out"
            if key == "recounted":   # this step's totals over every rank
                assert {a[3] for a in after} == {sum(t // 2 for r in range(world) for t in tokens[r][p])}
                assert {a[4] for a in after} == {sum(len(tokens[r][p]) for r in range(world))}
            else:                    # step_totals: the optimizer step's counts, unchanged
                assert {(a[3], a[4]) for a in after} == {(777, 55)}
            assert [a[5] for a in after] == [rank_cost(mode, c) for c in column]   # recosted where it lands
        for rank, r in enumerate(results):
            res = r[key]
            born_here = {uid: index for slot in r["before"] for uid, index in slot}
            for slot in res["slots"]:
                for uid, index, _ in slot[0]:
                    if uid in born_here:       # stayed: same uid, same sample
                        assert born_here[uid] == index and uid not in res["sent"]
                    else:                      # arrived: a fresh uid, and the sample's own payload
                        payload = res["received"][uid]
                        assert uid < 0 and payload["index"] == index and payload["born_on"] != rank
                        assert index in indices[payload["born_on"]][0] + indices[payload["born_on"]][1]
            assert sorted(res["sent"]) == sorted(set(born_here) - {u for s in res["slots"] for u, _, _ in s[0]})
            assert len(res["received"]) == sum(1 for s in res["slots"] for u, _, _ in s[0] if u not in born_here)
            sent += len(res["sent"])
            received += len(res["received"])
            m = res["metrics"]
            assert m["balance_max_over_lb"] < m["balance_max_over_lb_before"]
            if ranks_per_node == world:      # one node: every byte stays on it
                assert m["balance_bytes_inter_node"] == 0
            else:                            # a node per rank: every byte crosses nodes
                assert m["balance_bytes_intra_node"] == 0
        assert sent == received > 0
        total_bytes = sum(r[key]["metrics"]["balance_bytes_intra_node"] + r[key]["metrics"]["balance_bytes_inter_node"]
                          for r in results)
        assert total_bytes > 0
    # the exchange is addressed to the slots' epoch and round (each rebalance: one size exchange)
    assert all(r["exchanges"] == [("balance sizes", 1, 4)] * 2 for r in results)


def _regroup_rank(rank, world):
    from odb_factory import SampleCost
    from odb_factory.comm import SyncChannel
    from odb_factory.loader.step_rebalancer import StepRebalancer
    from odb_factory.planning.grouping import Budget, PlannedSample
    from odb_factory.planning.rounds import Slot
    # three thin steps of short samples: global grouping fits them in fewer steps
    tokens = [[[10, 12], [9], [11]], [[8], [13, 7], [6]]]
    costs = [[[SampleCost(t, t) for t in slot] for slot in r] for r in tokens]
    budget = Budget(64)
    slots = []
    for p, slot in enumerate(costs[rank]):
        samples = tuple(PlannedSample((p, i), 100 * rank + 10 * p + i, c) for i, c in enumerate(slot))
        slots.append(Slot(samples, 0, p, 0, 0, budget.group_cost(samples)))
    rebalancer = StepRebalancer(SyncChannel.create(30.0), None, budget, global_grouping=True, seed="1")
    moved = rebalancer.rebalance(slots, costs, lambda uid: ("payload", rank, uid), epoch=0)
    return ([[s.index for s in slot.samples] for slot in moved.slots], [slot.padded_tokens for slot in moved.slots],
            moved.metrics["global_grouping_rounds"])


@pytest.mark.slow
def test_global_grouping_moves_samples_into_fewer_steps_within_the_budget():
    results = run_world(_regroup_rank, 2, timeout=60)
    steps = {len(r[0]) for r in results}
    assert len(steps) == 1 and steps.pop() < 3
    got = sorted(i for r in results for slot in r[0] for i in slot)
    assert got == [0, 1, 10, 20, 100, 110, 111, 120]
    assert all(cost <= 64 for r in results for cost in r[1])
    assert all(r[2] == 1.0 for r in results)


def test_global_grouping_is_seeded_by_the_run_seed_epoch_and_round(monkeypatch):
    """Every rank derives the same regrouping from (seed, epoch, round): the seed reaching the
    planner is that triple, read from the slots being re-laid out."""
    from odb_factory.loader import step_rebalancer
    from odb_factory.planning.grouping import PlannedSample
    from odb_factory.planning.rounds import Slot
    seeds, real = [], step_rebalancer.regroup_round

    def spy(all_costs, budget, ranks_per_node, seed):
        seeds.append(seed)
        return real(all_costs, budget, ranks_per_node, seed=seed)
    monkeypatch.setattr(step_rebalancer, "regroup_round", spy)
    budget = Budget(64)
    sample = PlannedSample(0, 5, SampleCost(10, 10))
    slots = [Slot((sample,), 6, 0, 10, 1, budget.group_cost([sample]))]   # a round of one step
    moved = local(1, spec=None, budget=budget, global_grouping=True, seed="run7").rebalance(
        slots, [[[sample.cost]]], lambda uid: uid, epoch=2)
    assert [[s.index for s in slot.samples] for slot in moved.slots] == [[5]]
    local(1, spec=None, budget=budget, global_grouping=True).rebalance(slots, [[[sample.cost]]], lambda uid: uid,
                                                                       epoch=0)
    assert seeds == ["run7:2:6", ":0:6"]   # without a run seed: the empty string
