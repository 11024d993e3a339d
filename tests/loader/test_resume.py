"""Stop mid-epoch, restore in fresh processes, finish: nothing lost or repeated."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from tests.helpers.distributed import run_world

N = 157


def _make(join, workers, global_grouping=False):
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate
    ds = LengthDataset(long_tail_lengths(N, cv=1.0, mean=50, seed=5, maximum=600))
    cfg = ODBConfig(token_budget=400, join=join, buffer_size=24, outstanding_depth=3,
                    global_grouping=global_grouping)
    return ODBDataLoader(ds, cfg, collate_fn=pad_collate, num_workers=workers)


def _uninterrupted(rank, world, join, workers, global_grouping=False):
    loader = _make(join, workers, global_grouping)
    out = [i for step in loader for i in step.indices]
    loader.close()
    return out


def _first_part(rank, world, join, workers, stop_after, state_dir, global_grouping=False):
    loader = _make(join, workers, global_grouping)
    out = []
    for step in loader:
        out += step.indices
        if step.step + 1 == stop_after:
            break
    Path(state_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(loader.state_dict()))
    loader.close()
    return out


def _second_part(rank, world, join, workers, state_dir, global_grouping=False):
    loader = _make(join, workers, global_grouping)
    loader.load_state_dict(pickle.loads(Path(state_dir, f"rank{rank}.pkl").read_bytes()))
    out = [i for step in loader for i in step.indices]
    loader.set_epoch(1)
    next_epoch = [i for step in loader for i in step.indices]
    loader.close()
    return out, next_epoch


# global grouping: samples change rank before they are trained; a resume skips what any rank trained
@pytest.mark.parametrize("join,workers,global_grouping", [(True, 1, False), (False, 0, False), (True, 1, True)])
def test_resume_mid_epoch(tmp_path, join, workers, global_grouping):
    world = 2
    full = run_world(_uninterrupted, world, join, workers, global_grouping)
    first = run_world(_first_part, world, join, workers, 5, str(tmp_path), global_grouping)
    second = run_world(_second_part, world, join, workers, str(tmp_path), global_grouping)
    before = [i for part in first for i in part]
    after = [i for part, _ in second for i in part]
    assert len(before) > 0 and len(after) > 0
    if join:
        assert sorted(before + after) == sorted(i for part in full for i in part) == list(range(N))
        assert not set(before) & set(after)
        assert sorted(i for _, nxt in second for i in nxt) == list(range(N))
    else:
        assert len(before) + len(after) == sum(map(len, full)) == N


def _load_foreign(rank, world, state_dir):
    """Each rank is handed its peer's state, then its own with another world size, then its own
    saved with post-balancing (this loader runs without), then its own of another version."""
    loader = _make(True, 0)
    errors = []
    peer = pickle.loads(Path(state_dir, f"rank{1 - rank}.pkl").read_bytes())
    own = pickle.loads(Path(state_dir, f"rank{rank}.pkl").read_bytes())
    balanced = dict(own, config=dict(own["config"], balance=True))
    for state in (peer, dict(own, world_size=3), balanced, dict(own, version=2)):
        try:
            loader.load_state_dict(state)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    loader.load_state_dict(own)  # its own state loads
    loader.close()
    return errors


def test_a_foreign_state_is_refused_by_rank_and_world_size(tmp_path):
    """Another rank's state would train its samples twice on this rank (and lose this rank's);
    another world size would plan other views: both are refused by name."""
    run_world(_first_part, 2, True, 0, 3, str(tmp_path))
    for rank, (peer, other_world, other_options, other_version) in enumerate(
            run_world(_load_foreign, 2, str(tmp_path))):
        assert peer == (f"ODB state of rank {1 - rank} given to rank {rank}: each rank resumes from the state "
                        "it saved (save one per rank, load it on the same rank)")
        assert other_world == "ODB state was saved with world size 3, this run has 2"
        assert other_options == ("ODB state was saved with different planning options: ODBConfig.balance (YAML key "
                                 "odb_balance) is False now, True in the state. Resume with the options it was "
                                 "saved with")
        assert other_version == ("ODB state of version 2: this odb-factory reads version 1 "
                                 "(ODBDataLoader.state_dict); resume with the release that saved it")


def test_a_state_counts_the_epoch_it_was_saved_in():
    """One process, samples mode: a state before any step holds nothing trained; one saved
    mid-way through epoch 1 counts that epoch's samples and steps, not epoch 0's."""
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate
    ds = LengthDataset(long_tail_lengths(40, cv=1.0, mean=50, seed=5, maximum=600))
    loader = ODBDataLoader(ds, ODBConfig(token_budget=600, step_mode="samples", standard_batch_size=4,
                                         gradient_accumulation_steps=2), collate_fn=pad_collate)
    fresh = loader.state_dict()
    assert {k: v for k, v in fresh.items() if k != "config"} == {
        "version": 1, "epoch": 0, "rank": 0, "world_size": 1, "consumed": [], "consumed_global": 0,
        "steps": 0, "optimizer_steps": 0, "micro_steps_in_step": 0}
    assert fresh["config"] == loader.config.planning_fields()
    assert len([step for step in loader]) > 5   # epoch 0, whole
    loader.set_epoch(1)
    trained, counted, ends, since_end = [], 0, 0, 0
    for micro, step in enumerate(loader, start=1):
        trained += step.indices
        counted += step.global_num_samples   # the optimizer step's, on its first micro-step
        ends, since_end = ends + step.optimizer_step_end, 0 if step.optimizer_step_end else since_end + 1
        if ends == 1 and since_end == 1:   # one micro-step into the second optimizer step
            break
    state = loader.state_dict()
    loader.close()
    assert {k: state[k] for k in ("epoch", "consumed", "consumed_global", "steps", "optimizer_steps",
                                  "micro_steps_in_step")} == {
        "epoch": 1, "consumed": sorted(trained), "consumed_global": counted, "steps": micro,
        "optimizer_steps": 1, "micro_steps_in_step": 1}
    assert counted == 2 * 4 * 2   # two optimizer steps begun, 4 x 2 samples each
