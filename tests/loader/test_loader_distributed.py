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


def _loss_scales(rank, world):
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate
    ds = LengthDataset(long_tail_lengths(120, cv=1.0, mean=40, seed=3, maximum=300))
    loader = ODBDataLoader(ds, ODBConfig(token_budget=256, buffer_size=8, outstanding_depth=2, loss_scaling="none",
                                         sync_timeout_s=60), collate_fn=pad_collate)
    scales = [(step.is_idle, step.loss_scale) for step in loader]
    loader.close()
    return scales


def test_an_idle_step_trains_with_weight_zero_whatever_the_loss_scaling():
    """`loss_scaling: none` leaves a group's loss as computed (scale 1), but an IDLE step's
    filler batch must still add nothing to the gradient (scale 0), while its peers' steps
    carry supervised tokens."""
    scales = [s for rank in run_world(_loss_scales, 3, timeout=120) for s in rank]
    assert (True, 0.0) in scales, "this world trains no IDLE step"
    assert set(scales) == {(True, 0.0), (False, 1.0)}


def _accumulation_windows(rank, world):
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate
    ds = LengthDataset(long_tail_lengths(120, cv=1.0, mean=40, seed=3, maximum=300))
    loader = ODBDataLoader(ds, ODBConfig(token_budget=256, buffer_size=8, outstanding_depth=2,
                                         gradient_accumulation_steps=3, pad_epoch_to_accumulation=True,
                                         sync_timeout_s=60), collate_fn=pad_collate)
    steps = [(step.is_idle, step.label_tokens, step.global_label_tokens, step.padded_tokens, step.loss_scale)
             for step in loader]
    loader.close()
    return steps


def test_idle_steps_complete_the_last_accumulation_window_with_nothing():
    """pad_epoch_to_accumulation: IDLE steps fill the epoch's last window of 3 micro-steps; they
    carry no tokens, so every step of a window reports the window's supervised tokens summed
    over its steps and ranks, and each rank's loss scales of a window sum to its share of them."""
    world = 3
    ranks = run_world(_accumulation_windows, world, timeout=120)
    assert len({len(steps) for steps in ranks}) == 1 and len(ranks[0]) % 3 == 0
    assert any(steps[-1][0] for steps in ranks), "no rank's last window was filled"
    for start in range(0, len(ranks[0]), 3):
        windows = [steps[start:start + 3] for steps in ranks]
        total = sum(label for window in windows for _, label, *_ in window)
        assert {global_tokens for window in windows for _, _, global_tokens, *_ in window} == {total}
        for window in windows:
            assert all(padded == 0 for idle, _, _, padded, _ in window if idle)
            assert sum(scale for *_, scale in window) == pytest.approx(
                world * sum(label for _, label, *_ in window) / total)
