"""Real multi-process runs of the loader over gloo: alignment, coverage, quota, leaks."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.helpers.distributed import run_world

N = 203  # not divisible by 2 or 3: uneven shards


def _ledger_run(rank, world, join, workers, collate_workers, start_method, epochs):
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate

    ds = LengthDataset(long_tail_lengths(N, cv=1.0, mean=60, seed=1, maximum=900))
    cfg = ODBConfig(token_budget=512, join=join, buffer_size=32, outstanding_depth=4,
                    multiprocessing_context=start_method, sync_timeout_s=120)
    loader = ODBDataLoader(ds, cfg, collate_fn=pad_collate, num_workers=workers,
                           num_collate_workers=collate_workers)
    per_epoch, children = [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        steps = []
        for step in loader:
            # the collated data is the planner's group, in order
            assert step.data["index"].tolist() == (step.indices or step.data["index"].tolist())
            if not step.is_idle:
                assert step.label_tokens == int((step.data["labels"] != -100).sum())
            steps.append((step.step, step.indices, step.is_idle, step.label_tokens,
                          step.global_label_tokens, step.padded_tokens))
        per_epoch.append(steps)
        children.append(len(mp.active_children()))
    loader.close()
    return {"epochs": per_epoch, "children": children, "after_close": len(mp.active_children()),
            "metrics": loader.metrics.summary()}


CASES = [
    # world, join, workers, collate workers, start method
    (2, True, 2, 1, "fork"),
    (3, True, 1, 1, "spawn"),
    (3, False, 1, 0, "fork"),
    (2, False, 1, 1, "spawn"),
    (2, True, 1, 1, "forkserver"),
    (5, True, 0, 0, "spawn"),
    (7, False, 0, 0, "spawn"),
]


@pytest.mark.parametrize("world,join,workers,collate_workers,start_method", CASES)
def test_ledgers_three_epochs(world, join, workers, collate_workers, start_method):
    results = run_world(_ledger_run, world, join, workers, collate_workers, start_method, 3)
    for epoch in range(3):
        runs = [r["epochs"][epoch] for r in results]
        # DGAP: every rank runs the same number of steps
        assert len({len(steps) for steps in runs}) == 1
        trained = [i for steps in runs for (_, idx, *_rest) in steps for i in idx]
        if join:
            assert sorted(trained) == list(range(N)), "join: each index exactly once"
        else:
            assert len(trained) == N, "non-join: exact sample quota"
        for s in range(len(runs[0])):
            # every rank agrees on the global token count of each step's window
            assert len({steps[s][4] for steps in runs}) == 1
            # accumulation 1: the window is this step, so it is exactly the ranks' sum
            assert runs[0][s][4] == sum(steps[s][3] for steps in runs)
        for steps in runs:
            for (_, idx, idle, _, _, padded) in steps:
                assert idle == (not idx)
                assert padded <= 512 or len(idx) == 1
    for r in results:
        # persistent workers: the same processes every epoch, none after close()
        assert len(set(r["children"])) == 1
        assert r["children"][0] == workers + collate_workers
        assert r["after_close"] == 0
