"""plan_step (one aligned step's post-balancing) against hand-computed plans."""

from __future__ import annotations

import math

import pytest

from odb_factory import SampleCost
from odb_factory.balance import QWEN3_VL_LLM, QWEN3_VL_VISION, StageCostModel
from odb_factory.balance.step_plan import BYTES_PER_TOKEN, StepBalance, plan_step

IDENTITY = StageCostModel(0.0, 1.0, 0.0)   # cost = padded length


def c(tokens):
    return SampleCost(tokens, tokens)


def test_padded_plan_rounds_lengths_and_balances_by_hand():
    # pad to 8: lengths 16, 8 on rank 0 and 24 on rank 1. Best split: {24} | {16, 8} -> 24, 32
    # (the other one, {24, 16} | {8}, costs 48). Every sample stays where it is.
    plan = plan_step([[c(9), c(3)], [c(17)]], StepBalance(pad_to_multiple_of=8, cost_model=IDENTITY))
    assert plan.mode == "padded"
    assert plan.cost_before == [2 * 16, 24] and sorted(plan.cost_per_rank) == [24, 32]
    assert plan.lower_bound == max((16 + 8 + 24) / 2, 24)
    assert plan.destinations == [[(0, 0), (0, 1)], [(1, 0)]] and plan.bytes_moved == 0
    unpadded = plan_step([[c(9), c(3)], [c(17)]], StepBalance(cost_model=IDENTITY))
    assert unpadded.cost_before == [2 * 9, 17]


def test_padded_plan_moves_samples_and_counts_their_bytes():
    # Rank 0 holds three 10-token samples, rank 1 none: two ranks of {10, 10} | {10} at best.
    plan = plan_step([[c(10), c(10), c(10)], []], StepBalance(cost_model=IDENTITY))
    assert sorted(plan.cost_per_rank) == [10, 20] and plan.cost_before == [30, 0]
    assert len(plan.moves) == 1 and plan.bytes_moved == 10 * BYTES_PER_TOKEN == 80
    assert plan.bytes_inter_node == 80                      # one rank per node by default
    same_node = plan_step([[c(10), c(10), c(10)], []], StepBalance(ranks_per_node=2, cost_model=IDENTITY))
    assert (same_node.bytes_intra_node, same_node.bytes_inter_node) == (80, 0)


def test_default_model_is_the_llm_flop_model_of_the_longest_sample():
    plan = plan_step([[c(1000), c(10)], [c(300)]], StepBalance())
    def g(length):  # Qwen3-VL LLM: a * l + b * l ** 2, written out
        return QWEN3_VL_LLM.a * length + QWEN3_VL_LLM.b * length ** 2
    assert plan.cost_before == [2 * g(1000), g(300)]
    assert math.isclose(plan.lower_bound, max((g(1000) + g(10) + g(300)) / 2, g(1000)), rel_tol=1e-12)


def test_lpt_plan_sums_model_costs():
    model = StageCostModel(1.0, 2.0, 0.0)                 # 1 + 2 l
    plan = plan_step([[c(7), c(5), c(1)], [c(2)]], StepBalance(mode="lpt", pad_to_multiple_of=4,
                                                                cost_model=model))
    # lengths 8, 8, 4 | 4 -> costs 17, 17, 9 | 9
    assert plan.mode == "lpt" and plan.cost_before == [17 + 17 + 9, 9]
    assert sorted(plan.cost_per_rank) == [17 + 9, 17 + 9]
    assert plan.target is None


def test_min_move_uses_the_tolerance():
    costs = [[c(10), c(10), c(10), c(10)], [c(10), c(10)]]   # 4 vs 2: lower bound 3 samples
    tight = plan_step(costs, StepBalance(mode="min_move", tolerance=0.0, cost_model=IDENTITY))
    assert tight.target == 30 and tight.target_met and sorted(tight.cost_per_rank) == [30, 30]
    loose = plan_step(costs, StepBalance(mode="min_move", tolerance=0.5, cost_model=IDENTITY))
    assert loose.target == 45 and loose.moves == [] and loose.cost_per_rank == [40, 20]


def test_packed_plans_price_each_samples_vision_with_it_padded_plans_do_not():
    """Rank 0: one 10-token sample with 100 patches; rank 1: three 10-token samples without.
    The encoder runs where the sample trains, so a packed plan sees 10 + 100 against 30 and
    moves nothing; without the vision model it sees 10 | 30 and moves one sample to rank 0."""
    model = StageCostModel(0.0, 1.0, 0.0)
    costs = [[SampleCost(10, 10, vision_patches=100)], [c(10), c(10), c(10)]]
    for mode in ("lpt", "min_move"):
        plan = plan_step(costs, StepBalance(mode=mode, cost_model=model, vision_cost_model=model, tolerance=0.0))
        assert plan.cost_before == [110, 30] and plan.moves == [], mode
        blind = plan_step(costs, StepBalance(mode=mode, cost_model=model, vision_cost_model=None, tolerance=0.0))
        assert blind.cost_before == [10, 30] and sorted(blind.cost_per_rank) == [20, 20], mode
    padded = plan_step(costs, StepBalance(cost_model=model, vision_cost_model=model))
    assert padded.cost_before == [10, 30]
    # the default prices the vision tower per patch, without the per-image attention term
    default = plan_step(costs, StepBalance(mode="lpt"))
    assert default.cost_before[0] == pytest.approx(float(QWEN3_VL_LLM(10)) + 100 * QWEN3_VL_VISION.a)


@pytest.mark.parametrize("mode", ["padded", "lpt", "min_move"])
def test_token_cap_is_respected_or_the_step_stays_as_aligned(mode):
    costs = [[c(30), c(30), c(30)], [c(10)]]
    plan = plan_step(costs, StepBalance(mode=mode, token_budget=60, cost_model=IDENTITY))
    assert plan is not None
    for dest in plan.destinations:
        lengths = [costs[r][p].input_tokens for r, p in dest]
        assert len(lengths) * max(lengths, default=0) <= 60
    assert plan_step(costs, StepBalance(mode=mode, token_budget=50, cost_model=IDENTITY)) is None


def test_an_empty_step_has_no_plan():
    assert plan_step([[], []], StepBalance()) is None
    assert plan_step([], StepBalance()) is None




def test_padded_plan_under_a_token_cap_prices_steps_with_the_cost_model():
    """With a token cap the padded lengths bound each rank's tokens, while the costs stay the
    cost model's n * g(longest), not n * longest: rank 0's {100, 100} costs 2 * g(100)."""
    square = StageCostModel(0.0, 0.0, 1.0)   # g(l) = l^2
    costs = [[c(100), c(100)], [c(10)]]
    plan = plan_step(costs, StepBalance(cost_model=square, token_budget=400))
    assert plan.cost_before == [2 * 100.0 ** 2, 10.0 ** 2]
    for rank, dest in enumerate(plan.destinations):
        lengths = [costs[r][i].input_tokens for r, i in dest]
        assert plan.cost_per_rank[rank] == len(lengths) * max(lengths, default=0) ** 2
        assert len(lengths) * max(lengths, default=0) <= 400
