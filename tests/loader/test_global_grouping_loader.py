"""Global grouping with real ranks (gloo processes): the loader's steps are exactly the
simulated world's (the same pure planner on both sides, the samples moved by the exchange),
every index once (join) or the exact quota (non-join), token totals agreed, the collated data
is the planned group, alone or composed with post-balancing, in `groups` and `samples` mode."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers.distributed import run_world

N = 173
LENGTHS = dict(num_samples=N, cv=1.2, mean=70, seed=5, maximum=1500)


def _config(join: bool, balance: bool, cost_mode: str):
    from odb_factory import ODBConfig
    return ODBConfig(token_budget=640, join=join, buffer_size=24, outstanding_depth=4, global_grouping=True,
                     balance=balance, balance_mode="padded" if cost_mode == "padded" else "lpt",
                     cost_mode=cost_mode, pad_to_multiple_of=8, sync_timeout_s=120)


def _run(rank, world, join, balance, cost_mode):
    from odb_factory import ODBDataLoader
    from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate
    ds = LengthDataset(long_tail_lengths(**LENGTHS))
    loader = ODBDataLoader(ds, _config(join, balance, cost_mode), collate_fn=pad_collate, num_workers=1)
    steps = []
    for step in loader:
        assert step.data["index"].tolist() == (step.indices or step.data["index"].tolist())
        if not step.is_idle:
            assert step.label_tokens == int((step.data["labels"] != -100).sum())
        steps.append({"indices": step.indices, "label_tokens": step.label_tokens, "global": step.global_label_tokens,
                      "samples": step.global_num_samples, "metrics": step.metrics})
    loader.close()
    return steps


@pytest.mark.parametrize("world,join,balance,cost_mode", [(2, True, False, "padded"), (4, False, False, "packed"),
                                                          (3, True, True, "packed")])
def test_loader_steps_equal_the_simulated_world(world, join, balance, cost_mode):
    from odb_factory.cost import DefaultCost
    from odb_factory.planning.simulated_world import simulate_epoch
    from odb_factory.synthetic import LengthDataset, long_tail_lengths
    results = run_world(_run, world, join, balance, cost_mode)
    assert len({len(r) for r in results}) == 1, "the same steps on every rank"
    trained = [i for r in results for s in r for i in s["indices"]]
    if join:
        assert sorted(trained) == list(range(N)), "join: every index once"
    else:
        assert len(trained) == N, "non-join: the exact quota"
    for k in range(len(results[0])):
        row = [r[k] for r in results]
        assert len({s["global"] for s in row}) == 1
        assert sum(s["label_tokens"] for s in row) == row[0]["global"]
        assert row[0]["samples"] == sum(len(s["indices"]) for s in row)
        assert any(s["indices"] for s in row), "no step idle on every rank"
    regrouped = sum(s["metrics"].get("global_grouping_rounds", 0.0) for s in results[0])
    assert regrouped > 0, "global grouping re-laid out rounds"
    if not balance:  # the simulation does not post-balance: without it, the same steps exactly
        ds = LengthDataset(long_tail_lengths(**LENGTHS))
        cost = DefaultCost()
        sim = simulate_epoch([cost(ds[i]) for i in range(N)], _config(join, balance, cost_mode), world)
        for r in range(world):
            assert [s["indices"] for s in results[r]] == [[x.index for x in slot.samples] for slot in sim.slots[r]]
        plain = simulate_epoch([cost(ds[i]) for i in range(N)],
                               dataclasses.replace(_config(join, balance, cost_mode), global_grouping=False), world)
        assert [[x.index for x in slot.samples] for slot in plain.slots[0]] != [s["indices"] for s in results[0]]
