"""Bad input gets a clear error, never a hang."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_world
from odb_factory import ODBConfig, ODBDataLoader
from odb_factory.cost import MissingCostKeyError
from odb_factory.planning.grouping import OverBudgetError
from odb_factory.synthetic import LengthDataset, pad_collate


@pytest.mark.parametrize("field,value", [("token_budget", 0), ("token_budget", -5),
                                         ("buffer_size", 0), ("sync_timeout_s", 0),
                                         ("cost_mode", "padding")])
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ODBConfig(**{field: value})


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ValueError, match="did you mean 'token_budget'"):
        ODBConfig.from_dict({"token_budgte": 100})


class _NoIds(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"text": "x"}


class _Broken(LengthDataset):
    def __getitem__(self, index):
        if index == 7:
            raise ValueError("cannot decode image of sample 7")
        return super().__getitem__(index)


def _broken_collate(samples):
    if any(int(s["index"]) == 3 for s in samples):
        raise RuntimeError("collate failed on sample 3")
    return pad_collate(samples)


@pytest.mark.parametrize("workers", [0, 1])
def test_missing_cost_key_names_the_sample(workers):
    loader = ODBDataLoader(_NoIds(), ODBConfig(), num_workers=workers)
    with pytest.raises(MissingCostKeyError, match=r"dataset sample \d+: sample has no 'input_ids'"):
        list(loader)
    loader.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_over_budget_error_names_the_sample(workers):
    ds = LengthDataset([10, 10, 500, 10])
    loader = ODBDataLoader(ds, ODBConfig(token_budget=100, over_budget="error"), num_workers=workers)
    with pytest.raises(OverBudgetError, match="sample 2 costs 500 tokens"):
        list(loader)
    loader.close()


def test_over_budget_singleton_is_trained_and_counted():
    ds = LengthDataset([10, 10, 500, 10])
    loader = ODBDataLoader(ds, ODBConfig(token_budget=100), collate_fn=pad_collate)
    steps = list(loader)
    assert sorted(i for s in steps for i in s.indices) == [0, 1, 2, 3]
    assert [s.indices for s in steps if 2 in s.indices] == [[2]]
    assert loader.metrics.summary()["over_budget"] == 1


@pytest.mark.parametrize("workers,collate_workers", [(1, 0), (0, 1), (2, 2)])
def test_worker_exceptions_keep_their_traceback(workers, collate_workers):
    ds = _Broken([20] * 12)
    loader = ODBDataLoader(ds, ODBConfig(token_budget=100, buffer_size=4), collate_fn=pad_collate,
                           num_workers=workers, num_collate_workers=collate_workers)
    with pytest.raises(ValueError, match="cannot decode image of sample 7") as info:
        list(loader)
    if workers:
        assert "Original Traceback" in str(info.value)
        assert "_Broken" in str(info.value) or "__getitem__" in str(info.value)
    loader.close()
    collate_fail = ODBDataLoader(LengthDataset([20] * 12), ODBConfig(token_budget=100, buffer_size=4),
                                 collate_fn=_broken_collate, num_collate_workers=collate_workers)
    with pytest.raises(RuntimeError, match="collate failed on sample 3"):
        list(collate_fail)
    collate_fail.close()


@pytest.mark.parametrize("workers,collate_workers,planner_thread", [(0, 0, False), (1, 0, True),
                                                                     (0, 1, True)])
def test_planning_runs_in_the_training_thread_only_without_workers(workers, collate_workers,
                                                                   planner_thread):
    import threading
    # outstanding_depth 1: a planner thread is still planning while the first steps arrive
    loader = ODBDataLoader(LengthDataset([20] * 240), ODBConfig(token_budget=100, buffer_size=4,
                                                                outstanding_depth=1),
                           collate_fn=pad_collate, num_workers=workers,
                           num_collate_workers=collate_workers)
    seen, indices = set(), []
    for step in loader:
        seen.update(t.name for t in threading.enumerate() if t.name.startswith("odb-planner"))
        indices += step.indices
    loader.close()
    assert bool(seen) == planner_thread, seen
    assert sorted(indices) == list(range(240))


def _tiny_dataset(rank, world):
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset
    ODBDataLoader(LengthDataset([5, 6]), ODBConfig())


def _mismatched(rank, world):
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset
    loader = ODBDataLoader(LengthDataset([5] * 10), ODBConfig(token_budget=100 + rank, sync_timeout_s=30))
    list(loader)


def _one_rank_stops(rank, world):
    import time
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset
    loader = ODBDataLoader(LengthDataset([30] * 400),
                           ODBConfig(token_budget=60, buffer_size=4, outstanding_depth=2, sync_timeout_s=4))
    for step in loader:
        if rank == 1:
            break  # this rank stops training; rank 0 goes on alone
    if rank == 1:
        time.sleep(12)
    return "finished"


def test_dataset_smaller_than_world():
    results = run_world(_tiny_dataset, 3, expect_errors=True)
    assert all(status == "error" and "fewer than the 3 ranks" in text for status, text in results)


def test_config_mismatch_is_reported_at_start():
    results = run_world(_mismatched, 2, expect_errors=True)
    for status, text in results:
        assert status == "error"
        assert "ODB option 'token_budget' differs between rank" in text
        assert "(100)" in text and "(101)" in text


def test_collective_timeout_names_rank_and_round():
    results = run_world(_one_rank_stops, 2, expect_errors=True, timeout=120)
    status, text = results[0]
    assert status == "error"
    assert "ODBSyncError" in text and "rank 0/2" in text and "round" in text and "timeout 4s" in text
    assert results[1] == ("ok", "finished")


def test_standard_steps_outside_the_dataset_are_named():
    from odb_factory.planning.optimizer_steps import StandardStep
    steps = [StandardStep(((0, 1),)), StandardStep(((9, -1, 10, 11, 12, 13, 14, 3),))]   # 10 samples: 0..9
    loader = ODBDataLoader(LengthDataset([5] * 10), ODBConfig(step_mode="samples", standard_batch_size=2),
                           collate_fn=pad_collate, standard_steps=lambda epoch: steps)
    with pytest.raises(ValueError) as raised:
        list(loader)
    assert str(raised.value) == ("standard_steps(0) names indices [-1, 10, 11, 12, 13] outside the dataset "
                                 "of 10 samples")


def test_samples_mode_follows_the_dataset_order_without_shuffle():
    loader = ODBDataLoader(LengthDataset([5] * 10), ODBConfig(step_mode="samples", standard_batch_size=2,
                                                              shuffle=False), collate_fn=pad_collate)
    assert [i for step in loader for i in step.indices] == list(range(10))
