"""PlannerThread / EpochPlanner: steps queued ahead in order, a pipeline error surfacing with
its own traceback, leave() announced to the peers as a Departure, and no planner thread left
alive once the epoch ends or the loader closes. World size 1 in this process, 2 real gloo
ranks where peers matter."""

from __future__ import annotations

import queue
import threading
import time
import traceback

import pytest

from odb_factory import SampleCost
from odb_factory.comm import SyncChannel
from odb_factory.comm.channel import Departure, PeerDeparted
from odb_factory.loader.planner_thread import (END_OF_EPOCH, EpochPlanner, PlannerFailure, PlannerThread,
                                               SampleStore)
from odb_factory.planning.grouping import Budget
from odb_factory.planning.rounds import RankPlanner
from tests.helpers.distributed import run_world


def lengths_of(n, rank=0):
    """Varied sample lengths (8..60 tokens) under a 64-token budget: 1-7 samples a group."""
    return [8 + (7 * i + 13 * rank) % 53 for i in range(n)]


def decode(lengths, fail_at, first_index):
    """The rank's sample pipeline: (index, sample, cost); sample `fail_at` cannot be decoded."""
    for i, n in enumerate(lengths):
        index = first_index + i
        if i == fail_at:
            raise ValueError(f"cannot decode image of sample {index}")
        yield index, {"index": index, "tokens": n}, SampleCost(n, n // 2)


def make_planner(sync, n=40, accumulation=1, fail_at=None, step_offset=0, pad=False, epoch=0):
    lengths = lengths_of(n, sync.rank)
    store = SampleStore(decode(lengths, fail_at, 1000 * sync.rank))
    rank_planner = RankPlanner(Budget(64), 4, store.stream(), rank=sync.rank)
    return EpochPlanner(rank_planner, store, sync, epoch, accumulation, filler=lambda: {"filler": True},
                        step_offset=step_offset, pad_to_window=pad)


def drain(out, timeout=10.0):
    """Every item the planner queued, up to and including END_OF_EPOCH or a PlannerFailure."""
    items = []
    while True:
        item = out.get(timeout=timeout)
        items.append(item)
        if item is END_OF_EPOCH or isinstance(item, PlannerFailure):
            return items


def wait_until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def planner_threads():
    return [t for t in threading.enumerate() if t.name.startswith("odb-planner") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_planner_thread_survives():
    yield
    wait_until(lambda: not planner_threads(), seconds=5.0)


def local():
    return SyncChannel(None, 0, 1, timeout_s=10.0)


# ------------------------------------------------------------------ one rank, in this process

def test_steps_are_queued_ahead_in_order_up_to_the_queue_size():
    planner = make_planner(local(), n=40, step_offset=7)
    out = queue.Queue(maxsize=2)
    thread = PlannerThread(planner, out)
    assert thread.name == "odb-planner-rank0-epoch0" and thread.daemon
    thread.start()
    wait_until(out.full)                # planned ahead of a trainer that has not asked yet ...
    time.sleep(0.3)
    assert out.qsize() == 2 and thread.is_alive()   # ... and no further than the queue holds
    items = drain(out)
    assert items[-1] is END_OF_EPOCH
    plans = items[:-1]
    assert [p.step for p in plans] == list(range(7, 7 + len(plans)))
    assert sorted(i for p in plans for i in p.indices) == list(range(40))   # every sample once
    for p in plans:
        assert [s["index"] for s in p.samples] == p.indices and not p.is_idle
        assert p.label_tokens == sum(n // 2 for n in (s["tokens"] for s in p.samples))
        assert p.global_label_tokens == p.label_tokens and p.step_end   # world 1, accumulation 1
    thread.join(5.0)
    assert not thread.is_alive(), "the thread ends with the epoch"
    assert planner.store.payloads == {}


def test_the_thread_plans_what_the_inline_planner_plans():
    out = queue.Queue(maxsize=3)
    thread = PlannerThread(make_planner(local(), n=30, accumulation=2), out)
    thread.start()
    threaded = drain(out)[:-1]
    thread.join(5.0)
    inline = list(make_planner(local(), n=30, accumulation=2).inline_plans())
    key = [(p.step, p.round, p.indices, p.global_label_tokens, p.step_end) for p in threaded]
    assert key == [(p.step, p.round, p.indices, p.global_label_tokens, p.step_end) for p in inline]
    # accumulation 2: a window's steps share its label-token total; the second one ends it
    for first, second in zip(threaded[0::2], threaded[1::2]):
        assert first.global_label_tokens == second.global_label_tokens == first.label_tokens + second.label_tokens
        assert (first.step_end, second.step_end) == (False, True)


def test_the_last_window_is_padded_with_idle_steps_of_the_last_trained_sample():
    plans = list(make_planner(local(), n=18, accumulation=4, pad=True).inline_plans())
    assert len(plans) % 4 == 0
    assert [p.step_end for p in plans] == [k % 4 == 3 for k in range(len(plans))]
    idle = [p for p in plans if p.is_idle]
    assert idle and all(p.step > max(q.step for q in plans if not q.is_idle) for p in idle)   # at the end
    last_trained = [p for p in plans if not p.is_idle][-1]
    assert len({s["tokens"] for s in last_trained.samples}) > 1, "the case must offer a choice"
    shortest = min(last_trained.samples, key=lambda s: s["tokens"])
    for p in idle:
        assert p.indices == [] and p.label_tokens == 0 and p.samples == [shortest]
    assert plans[-1].step_end and plans[-1].is_idle


def test_a_pipeline_error_surfaces_with_its_original_traceback():
    planner = make_planner(local(), n=40, fail_at=23)
    out = queue.Queue(maxsize=2)
    thread = PlannerThread(planner, out)
    thread.start()
    items = drain(out)
    thread.join(5.0)
    assert not thread.is_alive()
    failure = items[-1]
    assert isinstance(failure, PlannerFailure)
    assert all(not isinstance(p, PlannerFailure) and 23 not in p.indices for p in items[:-1])
    exc = failure.exc
    assert type(exc) is ValueError and str(exc) == "cannot decode image of sample 23"
    assert planner.failure is exc and planner.error_before(0) is exc   # every later step: this error
    # the traceback still leads to the line that raised, in the pipeline, not to the queue
    frames = traceback.extract_tb(exc.__traceback__)
    assert frames[-1].name == "decode" and "raise ValueError" in frames[-1].line
    with pytest.raises(ValueError, match="sample 23") as info:
        raise failure.exc           # what the training thread does with it
    assert any(entry.name == "decode" for entry in info.traceback)


def test_leave_stops_a_thread_waiting_for_room_in_the_queue():
    planner = make_planner(local(), n=40)
    out = queue.Queue(maxsize=1)
    thread = PlannerThread(planner, out)
    thread.start()
    wait_until(out.full)
    first = out.get()
    wait_until(out.full)
    planner.leave(last_step=first.step)   # the trainer stops iterating (or the loader closes)
    thread.join(5.0)
    assert not thread.is_alive()
    rest = [out.get_nowait() for _ in range(out.qsize())]
    assert len(rest) == 1 and rest[0] is not END_OF_EPOCH   # nothing queued after leaving


def test_error_before_follows_the_peers_departure():
    planner = make_planner(local())
    assert planner.error_before(5) is None
    planner.peer_departure = PeerDeparted([Departure(1, 0, "left", 3)], "'status' of epoch 0, round 2", 0)
    assert planner.error_before(3) is None          # still common to every rank
    late = planner.error_before(4)
    assert isinstance(late, PeerDeparted) and "this rank asked for step 4" in str(late)
    planner.peer_departure = PeerDeparted([Departure(1, 0, "failed", 3, "ValueError: x")], "'costs'", 0)
    assert planner.error_before(0) is planner.peer_departure   # a failure: at once
    own = RuntimeError("mine")
    planner.failure = own
    assert planner.error_before(0) is own


def test_the_loader_leaves_no_planner_thread_alive():
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset, pad_collate
    ds = LengthDataset(lengths_of(48))
    loader = ODBDataLoader(ds, ODBConfig(token_budget=64, buffer_size=4, outstanding_depth=2),
                           collate_fn=pad_collate, num_workers=1)
    try:
        steps = list(loader)                          # a whole epoch: the thread ends with it
        assert steps and not planner_threads()
        loader.set_epoch(1)
        it = iter(loader)
        next(it)
        assert [t.name for t in planner_threads()] == ["odb-planner-rank0-epoch1"]
        loader.close()                                # mid-epoch: close() stops it
        assert not planner_threads()
    finally:
        loader.close()


# ------------------------------------------------------------------ two real gloo ranks

def _leave_rank(rank, world, inline):
    import queue

    from odb_factory.comm import SyncChannel
    from odb_factory.comm.channel import PeerDeparted
    from odb_factory.loader.planner_thread import PlannerFailure, PlannerThread
    sync = SyncChannel.create(timeout_s=20.0)
    planner = make_planner(sync, n=60)
    if rank == 1:   # its trainer takes two steps, then stops iterating
        if inline:
            plans = planner.inline_plans()
            taken = [next(plans).step, next(plans).step]
            planner.leave(last_step=taken[-1])
            return taken, None
        out = queue.Queue(maxsize=1)
        thread = PlannerThread(planner, out)
        thread.start()
        taken = [out.get(timeout=20).step, out.get(timeout=20).step]
        planner.leave(last_step=taken[-1])
        thread.join(20)
        return taken, thread.is_alive()
    out = queue.Queue(maxsize=1)
    thread = PlannerThread(planner, out)
    thread.start()
    items = drain(out, timeout=20)
    thread.join(20)
    failure = items[-1]
    assert isinstance(failure, PlannerFailure) and isinstance(failure.exc, PeerDeparted), items[-1]
    exc = failure.exc
    steps = [p.step for p in items[:-1]]
    late = planner.error_before(exc.last_step + 1)
    return {"departures": [(d.rank, d.reason, d.last_step) for d in exc.departures], "text": str(exc),
            "steps": steps, "alive": thread.is_alive(), "common": planner.error_before(exc.last_step),
            "late": str(late)}


@pytest.mark.slow
@pytest.mark.parametrize("inline", [False, True], ids=["thread", "inline"])
def test_leave_announces_a_departure_that_reaches_the_peer(inline):
    (peer, (taken, leaver_alive)) = run_world(_leave_rank, 2, inline, timeout=60)
    assert taken == [0, 1] and not leaver_alive
    assert peer["departures"] == [(1, "left", 1)]
    assert peer["text"].startswith("ODB on rank 0: rank 1 stopped iterating epoch 0 after step 1")
    assert peer["steps"][:2] == [0, 1] and peer["common"] is None
    assert "rank 1 stopped iterating" in peer["late"] and "this rank asked for step 2" in peer["late"]
    assert not peer["alive"], "the peer's planner thread ended too"


def _failing_rank(rank, world):
    import queue

    from odb_factory.comm import SyncChannel
    from odb_factory.loader.planner_thread import PlannerFailure, PlannerThread
    sync = SyncChannel.create(timeout_s=20.0)
    planner = make_planner(sync, n=60, fail_at=30 if rank == 1 else None)
    out = queue.Queue(maxsize=2)
    thread = PlannerThread(planner, out)
    thread.start()
    items = drain(out, timeout=20)
    thread.join(20)
    failure = items[-1]
    assert isinstance(failure, PlannerFailure), failure
    return type(failure.exc).__name__, str(failure.exc), thread.is_alive()


@pytest.mark.slow
def test_a_pipeline_error_reaches_the_peer_naming_the_rank():
    (peer, own) = run_world(_failing_rank, 2, timeout=60)
    assert own == ("ValueError", "cannot decode image of sample 1030", False)
    name, text, alive = peer
    assert name == "PeerDeparted" and not alive
    assert text.startswith("ODB on rank 0: rank 1 failed in epoch 0: ValueError: cannot decode image of sample 1030")
