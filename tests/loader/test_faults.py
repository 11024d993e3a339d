"""Fault injection: a failure on one rank reaches every rank at once, named; ranks that leave
an epoch at different steps get an error, never a silent mismatch; resume keeps its
promises. Every world has a hard deadline (run_world's timeout), so a hang fails the test."""

from __future__ import annotations

import pickle
import re
import time

import pytest

from tests.helpers.distributed import child_env, run_world
from tests.helpers.stalling import StallsAt

N = 120
TIMEOUT = 20.0   # ODBConfig.sync_timeout_s in these worlds: an error must come well before it


def _loader(rank, workers=0, collate_workers=0, dataset=None, **cfg):
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate
    ds = dataset or LengthDataset(long_tail_lengths(N, cv=1.0, mean=40, seed=3, maximum=300))
    config = ODBConfig(**{"token_budget": 256, "buffer_size": 8, "outstanding_depth": 2,
                          "sync_timeout_s": TIMEOUT, **cfg})
    return ODBDataLoader(ds, config, collate_fn=pad_collate, num_workers=workers,
                         num_collate_workers=collate_workers)


class FailingDataset:
    """Sample `bad` raises (as a broken image would)."""

    def __init__(self, bad: int):
        from odb_factory.synthetic import LengthDataset, long_tail_lengths
        self.inner = LengthDataset(long_tail_lengths(N, cv=1.0, mean=40, seed=3, maximum=300))
        self.bad = bad

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        if index == self.bad:
            raise ValueError(f"cannot decode image of sample {index}")
        return self.inner[index]


def _bad_index_of(rank, world):
    from odb_factory.planning.views import epoch_view
    return epoch_view(N, world, rank, 0, 0)[30]   # late enough that training is under way


def _timed_epoch(loader, rank, failing_rank, stay_alive_s=0.0):
    """Iterate; return (error text or None, wall-clock time of the error or of the end)."""
    try:
        for _ in loader:
            pass
    except Exception as exc:
        text, at = f"{type(exc).__name__}: {exc}", time.time()
        if rank == failing_rank and stay_alive_s:
            time.sleep(stay_alive_s)      # e.g. writing an emergency checkpoint
        return text, at
    return None, time.time()


def _dataset_fails(rank, world, failing_rank, workers, stay_alive_s, balance):
    bad = _bad_index_of(failing_rank, world)
    loader = _loader(rank, workers=workers, dataset=FailingDataset(bad), balance=balance)
    return _timed_epoch(loader, rank, failing_rank, stay_alive_s)


@pytest.mark.parametrize("world,workers,stay_alive_s,balance", [
    (2, 0, 0.0, False),      # the failing process ends at once
    (2, 1, 15.0, False),     # it stays alive (an emergency checkpoint): peers must not wait for it
    (3, 0, 15.0, True),      # 3 ranks, with post-balancing
])
def test_dataset_error_on_one_rank_reaches_every_rank(world, workers, stay_alive_s, balance):
    failing = world - 1
    results = run_world(_dataset_fails, world, failing, workers, stay_alive_s, balance, timeout=120)
    times = {}
    for rank, (text, at) in enumerate(results):
        assert text is not None, f"rank {rank} finished the epoch although rank {failing} failed"
        assert f"cannot decode image of sample {_bad_index_of(failing, world)}" in text, text
        if rank != failing:
            assert f"rank {failing} failed in epoch 0" in text, text
        times[rank] = at
    spread = max(times.values()) - min(times.values())
    assert spread < 10.0, f"errors reached the ranks {spread:.1f}s apart: {times}"


def _worker_killed(rank, world, role):
    """Rank 1 kills one of its own workers at step 3; returns (error, wall time of the
    error, wall time of the kill)."""
    import os
    import signal
    loader = _loader(rank, workers=1, collate_workers=1)
    killed_at = None
    try:
        for step in loader:
            if rank == 1 and step.step == 3:
                source = loader._sample_loader if role == "sample" else loader._collate_loader
                killed_at = time.time()
                os.kill(source._iterator._workers[0].pid, signal.SIGKILL)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.time(), killed_at
    return None, time.time(), killed_at


@pytest.mark.parametrize("role", ["sample", "collate"])
def test_killed_worker_is_named_and_reaches_the_peer(role):
    (peer_text, peer_at, _), (text, own_at, killed_at) = run_world(_worker_killed, 2, role, timeout=120)
    assert text is not None and re.search(rf"{role} worker pid \d+ was killed by signal 9 on rank 1", text), text
    assert peer_text is not None, "the peer finished the epoch although rank 1 lost a worker"
    assert "rank 1" in peer_text, peer_text
    for at in (peer_at, own_at):
        assert at - killed_at < TIMEOUT / 2, f"an error came {at - killed_at:.1f}s after the kill"


def _rank_exits(rank, world):
    import os
    loader = _loader(rank)
    start = time.monotonic()
    try:
        for step in loader:
            if rank == 1 and step.step == 3:
                os._exit(3)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return None, time.monotonic() - start


def test_a_rank_that_exits_fails_its_peer_quickly():
    (status, (text, seconds)), dead = run_world(_rank_exits, 2, timeout=120, expect_dead=True,
                                                expect_errors=True)
    assert dead == ("died", 3)
    assert status == "ok" and text is not None and "ODBSyncError" in text, text
    assert seconds < TIMEOUT, f"the peer learned after {seconds:.1f}s"


def _break_then_continue(rank, world, break_at):
    """Leave epoch 0 after step break_at[rank] (errors caught, as a trainer that goes on
    would), then run epoch 1. Returns what happened in each epoch."""
    loader = _loader(rank)
    outcome = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        steps, start = [], time.monotonic()
        try:
            for step in loader:
                steps.append(step.step)
                if epoch == 0 and step.step == break_at[rank]:
                    break
            outcome.append(("ok", steps))
        except Exception as exc:
            outcome.append((f"{type(exc).__name__}: {exc}", time.monotonic() - start, steps))
    return outcome


def _slow_rank_outlived_by_its_plans(rank, world):
    """Rank 1 leaves after step 3; rank 0, slower (a long step), has planned steps ahead in its
    planner thread when it learns of it."""
    loader = _loader(rank, workers=1)
    steps = []
    try:
        for step in loader:
            steps.append(step.step)
            if rank == 1 and step.step == 3:
                break
            if rank == 0:
                time.sleep(0.5)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", steps
    finally:
        loader.close()
    return None, steps


def test_a_peers_departure_lets_the_steps_it_trained_through():
    """Planned steps the departed peer trained too are still trained (its gradients match
    them); the first step past its last is refused, naming where it left."""
    (text, steps), (left, trained) = run_world(_slow_rank_outlived_by_its_plans, 2, timeout=120)
    assert left is None and trained == [0, 1, 2, 3]
    assert steps == [0, 1, 2, 3], (steps, text)
    assert text is not None and "rank 1 stopped iterating epoch 0 after step 3" in text, text


def _stall_on_rank_1(rank, world):
    from odb_factory.planning.views import epoch_view
    from odb_factory.synthetic import LengthDataset, long_tail_lengths
    late = epoch_view(600, world, 1, 0, 0)[-4]   # past the samples fetched ahead of the first rounds
    dataset = StallsAt(LengthDataset(long_tail_lengths(600, cv=1.0, mean=40, seed=3, maximum=300)),
                       late if rank == 1 else None)
    loader = _loader(rank, dataset=dataset, sync_timeout_s=5.0)
    try:
        return _timed_epoch(loader, rank, 1)[0]
    finally:
        loader.close()


def test_a_stalled_peer_is_named_with_the_round_it_never_reached():
    """Groups mode: the rank left waiting names the exchange, its epoch and round (the sample
    stalls among rank 1's last, rounds into the epoch), and the rank that never came."""
    waiting, _ = run_world(_stall_on_rank_1, 2, timeout=180)
    where = re.search(r"ODB alignment exchange '(status|costs)' failed on rank 0/2 \(epoch 0, round (\d+)\)",
                      waiting or "")
    assert where is not None and int(where.group(2)) >= 2, waiting
    assert "Rank(s) [1] never entered this exchange" in waiting, waiting


def test_ranks_breaking_at_different_steps_get_an_error_not_a_mismatch():
    (zero, one) = run_world(_break_then_continue, 2, {0: 6, 1: 3}, timeout=120)
    assert one[0] == ("ok", [0, 1, 2, 3])
    if zero[0][0] == "ok":
        assert zero[0][1] == list(range(7))    # past rank 1's last step before it could know
        zero_last = 6
    else:
        # rank 0 learned from rank 1's departure notice and stopped, naming it
        text, seconds, steps = zero[0]
        assert "rank 1 stopped iterating epoch 0 after step 3" in text and seconds < TIMEOUT, text
        zero_last = steps[-1]
    if zero_last == 3:
        # both left after step 3: the next epoch is correct on both ranks
        assert zero[1][0] == one[1][0] == "ok" and zero[1][1] == one[1][1]
    else:
        # the next epoch refuses to start on both ranks, naming both sides
        for text, seconds, _ in (zero[1], one[1]):
            assert "left the previous epoch at different points" in text, text
            assert f"epoch 0 after step {zero_last}" in text and "epoch 0 after step 3" in text, text
            assert seconds < TIMEOUT


def test_ranks_breaking_at_the_same_step_continue_correctly():
    zero, one = run_world(_break_then_continue, 2, {0: 4, 1: 4}, timeout=120)
    assert zero == one
    assert zero[0] == ("ok", [0, 1, 2, 3, 4]) and zero[1][0] == "ok" and zero[1][1][0] == 0


def _mismatched_option(rank, world, field, values):
    loader = _loader(rank, **{field: values[rank]})
    try:
        list(loader)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _other_dataset_length(rank, world):
    from odb_factory.synthetic import LengthDataset, long_tail_lengths
    loader = _loader(rank, dataset=LengthDataset(long_tail_lengths(N - rank, cv=1.0, mean=40, seed=3, maximum=300)))
    try:
        list(loader)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        loader.close()
    return None


def test_ranks_with_datasets_of_different_lengths_are_refused():
    zero, one = run_world(_other_dataset_length, 2, timeout=120)
    assert zero is not None and f"ODB option 'dataset_length' differs between rank 0 ({N}) and rank 1 ({N - 1})" in zero
    assert one is not None and f"ODB option 'dataset_length' differs between rank 1 ({N - 1}) and rank 0 ({N})" in one


@pytest.mark.parametrize("field,values", [("outstanding_depth", (2, 16)),
                                          ("pad_epoch_to_accumulation", (True, False))])
def test_options_that_change_planning_must_agree(field, values):
    results = run_world(_mismatched_option, 2, field, values, timeout=120)
    for text in results:
        assert text is not None and f"ODB option '{field}' differs between rank" in text, text


def _quota_over_dataset(rank, world, quota, stops, state_dir):
    """Train a non-join epoch of `quota` samples (more than the dataset) in len(stops)+1
    pieces, each in a fresh loader restored from the previous piece's state."""
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate
    trained, state = 0, None
    for piece in range(len(stops) + 1):
        ds = LengthDataset(long_tail_lengths(40, cv=1.0, mean=40, seed=9, maximum=200))
        loader = ODBDataLoader(ds, ODBConfig(token_budget=256, join=False, quota=quota, buffer_size=8,
                                             outstanding_depth=2, sync_timeout_s=TIMEOUT),
                               collate_fn=pad_collate)
        if state is not None:
            loader.load_state_dict(state)
        for step in loader:
            trained += len(step.indices)
            if piece < len(stops) and step.step == stops[piece]:
                break
        state = loader.state_dict()
        loader.close()
    return trained


@pytest.mark.parametrize("world", [1, 2])
def test_nonjoin_quota_above_dataset_size_closes_across_stops(tmp_path, world):
    quota = 150   # dataset of 40
    trained = run_world(_quota_over_dataset, world, quota, [5, 12], str(tmp_path), timeout=180)
    assert sum(trained) == quota


def _state_right_after_load(rank, world, state_dir):
    first = _loader(rank)
    indices = []
    for step in first:
        indices += step.indices
        if step.step == 4:
            break
    state = first.state_dict()
    first.close()
    second = _loader(rank)
    second.load_state_dict(pickle.loads(pickle.dumps(state)))
    again = second.state_dict()            # a checkpoint written before the first resumed step
    second.close()
    third = _loader(rank)
    third.load_state_dict(again)
    rest = [i for step in third for i in step.indices]
    third.close()
    return state == again, indices, rest


def test_state_dict_right_after_load_keeps_the_progress(tmp_path):
    results = run_world(_state_right_after_load, 2, str(tmp_path), timeout=120)
    assert all(same for same, _, _ in results)
    before = [i for _, b, _ in results for i in b]
    after = [i for _, _, a in results for i in a]
    assert not set(before) & set(after)
    assert sorted(before + after) == list(range(N))


def test_state_dict_after_load_then_a_new_epoch_is_the_new_epochs():
    """A restored epoch-0 state is the state only while the loader stays at epoch 0: after
    set_epoch(1) a checkpoint must describe epoch 1 (which starts afresh), not epoch 0."""
    first = _loader(0)
    for step in first:
        if step.step == 3:
            break
    state = first.state_dict()
    first.close()
    second = _loader(0)
    second.load_state_dict(state)
    assert second.state_dict() == state
    second.set_epoch(1)
    moved = second.state_dict()
    assert (moved["epoch"], moved["consumed"], moved["steps"]) == (1, [], 0)
    second.set_epoch(0)                    # back at the restored epoch: the restored state again
    assert second.state_dict() == state
    second.close()


def _reiterate(rank, world):
    loader = _loader(rank)
    for step in loader:
        if step.step == 4:
            break
    return [step.step for step in loader]   # the same epoch again, from its start


def test_reiterating_an_epoch_counts_steps_from_zero():
    results = run_world(_reiterate, 2, timeout=120)
    assert results[0] == results[1] == list(range(len(results[0])))


def _leave_in_the_last_step(rank, world):
    """Groups mode, non-join (its last round closes with the quota: no exchange after it),
    planning in the training thread: count the epoch's steps, then train the epoch again with
    rank 1 leaving in its last step."""
    loader = _loader(rank, join=False)
    last = sum(1 for _ in loader) - 1
    start, trained = time.monotonic(), 0
    for step in loader:
        trained += 1
        if rank == 1 and step.step == last:
            break
    loader.close()
    return trained, last, time.monotonic() - start


def test_leaving_after_the_last_round_waits_for_no_peer():
    """No exchange follows the last round: a rank leaving in the epoch's last step has no peer
    to tell, and must not wait for one (sync_timeout_s) to take its notice."""
    (zero, last, _), (one, _, seconds) = run_world(_leave_in_the_last_step, 2, timeout=180)
    assert zero == one == last + 1
    assert seconds < TIMEOUT / 2, f"rank 1 left after {seconds:.0f}s"


def _late_for_the_second_epoch(rank, world):
    loader = _loader(rank, sync_timeout_s=3.0)
    list(loader)
    if rank == 1:
        time.sleep(8.0)    # e.g. a long evaluation on this rank only
    loader.set_epoch(1)
    try:
        return _timed_epoch(loader, rank, 1)[0]
    finally:
        loader.close()


def test_a_peer_late_for_an_epoch_is_named_with_the_epoch_it_never_started():
    waiting, _ = run_world(_late_for_the_second_epoch, 2, timeout=180)
    assert waiting is not None and waiting.startswith(
        "ODBSyncError: ODB alignment exchange 'epoch start' failed on rank 0/2 (epoch 1, round -1) after "), waiting
    assert "Rank(s) [1] never entered this exchange" in waiting, waiting


def _alive(pid: int) -> bool:
    from pathlib import Path
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_a_killed_rank_leaves_no_worker_process_behind():
    """SIGKILL a rank whose sample workers are blocked writing big samples to it: the workers
    die with it (without the parent-death signal they lived on, re-parented, for good)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "helpers" / "scripts" / "loader_then_sleep.py"
    env = child_env()
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    workers = []
    try:
        line = rank.stdout.readline().split()
        assert line and line[0] == "workers", line
        workers = [int(p) for p in line[1:]]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        time.sleep(1.0)  # the workers fill the pipe meanwhile
        rank.kill()
        rank.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in workers if _alive(p)] == []
    finally:
        rank.kill()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
