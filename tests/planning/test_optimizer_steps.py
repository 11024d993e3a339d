"""Pure planning of step_mode="samples": the fixed-batch steps, Standard's loss weights and
the per-step packing, checked against independent formulations."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory.cost import SampleCost
from odb_factory.planning.grouping import Budget, PlannedSample
from odb_factory.planning.optimizer_steps import (MICRO_MEAN, TOKEN_MEAN, StandardStep, align_step,
                                                  fixed_batch_steps, pack_step, sample_weights)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 120), world=st.integers(1, 8), batch=st.integers(1, 4), accumulation=st.integers(1, 5),
       epoch=st.integers(0, 3))
def test_fixed_batch_steps_cover_the_epoch_like_a_sharded_sampler(n, world, batch, accumulation, epoch):
    plans = [fixed_batch_steps(n, world, r, batch, accumulation, seed=1, epoch=epoch) for r in range(world)]
    assert len({len(p) for p in plans}) == 1                      # same optimizer steps everywhere
    for k in range(len(plans[0])):
        assert len({len(p[k].micro_batches) for p in plans}) == 1  # same micro-batches per step
        assert all(len(mb) == batch for p in plans for mb in p[k].micro_batches)
    counts = Counter(i for p in plans for step in p for i in step.indices)
    assert set(counts) == set(range(n))                           # every sample trained
    global_batches = -(-n // (batch * world))
    assert sum(counts.values()) == global_batches * batch * world  # the wrap-around fills the last batch
    assert max(counts.values()) - min(counts.values()) <= 1         # repeats spread evenly


@given(tokens=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=4), min_size=1, max_size=6))
def test_micro_mean_weights_reproduce_the_mean_of_micro_batch_means(tokens):
    # independent oracle: a rank's Standard loss with per-sample token-loss sums S_s is
    # (1/n) Σ_m (Σ_{s∈m} S_s) / T_m; with S_s = T_s (unit loss per token) it is the share
    # of micro-batches that have any supervised token
    step = StandardStep(tuple(tuple(range(len(mb))) for mb in tokens))
    flat = [t for mb in tokens for t in mb]
    weights = sample_weights(step, flat, MICRO_MEAN, world_size=1, global_label_tokens=sum(flat))
    expected = sum(1 for mb in tokens if sum(mb)) / len(tokens)
    assert abs(sum(w * t for w, t in zip(weights, flat)) - expected) < 1e-12


@given(tokens=st.lists(st.integers(0, 40), min_size=1, max_size=10), world=st.integers(1, 8),
       others=st.integers(0, 500))
def test_token_mean_weights_undo_the_ddp_average(tokens, world, others):
    step = StandardStep((tuple(range(len(tokens))),))
    total = sum(tokens) + others
    weights = sample_weights(step, tokens, TOKEN_MEAN, world_size=world, global_label_tokens=total)
    if total:
        assert abs(sum(w * t for w, t in zip(weights, tokens)) / world - sum(tokens) / total) < 1e-12


@settings(max_examples=300, deadline=None)
@given(shares=st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=12), min_size=1, max_size=6),
       budget=st.integers(64, 1024))
def test_packed_steps_align_and_stay_in_budget(shares, budget):
    b = Budget(budget)
    uid = iter(range(10 ** 6))
    per_rank = [[PlannedSample(next(uid), 0, SampleCost(t, t)) for t in share] for share in shares]
    groups = [pack_step(samples, b, "singleton") for samples in per_rank]
    counts = [len(g) for g in groups]
    slots = [align_step(g, counts, b) for g in groups]
    assert {len(s) for s in slots} == {max(counts)}
    for samples, rank_slots in zip(per_rank, slots):
        assert sorted(s.uid for slot in rank_slots for s in slot) == sorted(s.uid for s in samples)
        for slot in rank_slots:
            assert len(slot) <= 1 or len(slot) * max(s.cost.input_tokens for s in slot) <= budget
