"""SyncChannel: the envelope check (kind, epoch and round), Departures reaching the peers as
PeerDeparted, timeouts naming rank and round, and the local channel of a single process."""

from __future__ import annotations

import pytest

from odb_factory.comm import ODBSyncError, SyncChannel
from odb_factory.comm import channel as channel_module
from odb_factory.comm.channel import Departure, Envelope, PeerDeparted
from tests.helpers.distributed import reported_wait_s, run_world


# ------------------------------------------------------------------ in one process

def test_envelope_names_kind_epoch_and_round():
    assert Envelope("costs", 2, 7, None).where() == "'costs' of epoch 2, round 7"


def test_local_channel_returns_its_own_object_and_announces_to_nobody():
    sync = SyncChannel(None, 0, 1, timeout_s=5.0)
    payload = {"a": 1}
    out = sync.all_gather(payload, "status", epoch=3, round=1)
    assert out == [payload] and out[0] is payload
    sync.announce_departure(Departure(0, 3, "left", 5), "departure notice")  # no peer: no-op


def test_create_outside_torch_distributed_is_local():
    sync = SyncChannel.create(timeout_s=7.0)
    assert (sync.group, sync.rank, sync.world_size, sync.timeout_s) == (None, 0, 1, 7.0)


def _fake_world(monkeypatch, rank, world, new_group):
    dist = channel_module.dist
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "new_group", new_group)


def test_create_with_one_rank_needs_no_group(monkeypatch):
    def new_group(**kwargs):
        raise AssertionError("no group for a world of one")
    _fake_world(monkeypatch, 0, 1, new_group)
    sync = SyncChannel.create(timeout_s=3.0)
    assert (sync.group, sync.rank, sync.world_size, sync.timeout_s) == (None, 0, 1, 3.0)


def test_create_asks_for_a_gloo_group_with_the_timeout(monkeypatch):
    calls = []

    def new_group(**kwargs):
        calls.append(kwargs)
        return "the group"
    _fake_world(monkeypatch, 2, 4, new_group)
    sync = SyncChannel.create(timeout_s=42.0)
    assert (sync.group, sync.rank, sync.world_size, sync.timeout_s) == ("the group", 2, 4, 42.0)
    assert calls == [{"backend": "gloo", "timeout": channel_module.timedelta(seconds=42.0)}]


def test_create_refuses_to_run_without_the_channel(monkeypatch):
    def new_group(**kwargs):
        raise RuntimeError("Gloo is not available")
    _fake_world(monkeypatch, 1, 3, new_group)
    with pytest.raises(ODBSyncError, match=r"^rank 1: cannot create the ODB alignment channel "
                                           r"\(a Gloo group over 3 ranks\): Gloo is not available") as info:
        SyncChannel.create(timeout_s=3.0)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_peer_departed_message_and_properties():
    left = Departure(rank=2, epoch=1, reason="left", last_step=9)
    failed = Departure(rank=3, epoch=1, reason="failed", last_step=4, message="ValueError: bad image")
    one = PeerDeparted([left], "'costs' of epoch 1, round 5", rank=0)
    assert str(one) == ("ODB on rank 0: rank 2 stopped iterating epoch 1 after step 9 "
                        "(learned in exchange 'costs' of epoch 1, round 5)")
    assert not one.failed and one.last_step == 9 and one.departures == [left] and one.rank == 0
    both = PeerDeparted([left, failed], "'status' of epoch 1, round 6", rank=1, asked_for=10)
    assert both.failed and both.last_step == 4
    assert str(both) == ("ODB on rank 1: rank 2 stopped iterating epoch 1 after step 9; rank 3 failed in "
                         "epoch 1: ValueError: bad image (learned in exchange 'status' of epoch 1, round 6); "
                         "this rank asked for step 10 of that epoch: every rank must leave an epoch at the "
                         "same step")
    assert isinstance(both, ODBSyncError)


# ------------------------------------------------------------------ real gloo ranks

def _aligned(rank, world):
    from odb_factory.comm import SyncChannel
    sync = SyncChannel.create(timeout_s=30.0)
    first = sync.all_gather({"rank": rank}, "status", epoch=0, round=0)
    second = sync.all_gather(rank * 10, "costs", epoch=0, round=0)
    return (sync.group is not None, sync.rank, sync.world_size), first, second


@pytest.mark.slow
def test_aligned_ranks_get_every_payload_in_rank_order():
    world = 3
    results = run_world(_aligned, world, timeout=60)
    for rank, (channel, first, second) in enumerate(results):
        assert channel == (True, rank, world)
        assert first == [{"rank": r} for r in range(world)]
        assert second == [10 * r for r in range(world)]


def _out_of_step(rank, world, theirs):
    from odb_factory.comm import ODBSyncError, SyncChannel
    sync = SyncChannel.create(timeout_s=30.0)
    what, epoch, round = ("costs", 1, 5) if rank < world - 1 else theirs
    try:
        sync.all_gather([rank], what, epoch, round)
    except ODBSyncError as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("theirs", [("status", 1, 5),   # another kind of exchange
                                    ("costs", 2, 5),    # the same kind, another epoch
                                    ("costs", 1, 6)],   # the same kind and epoch, another round
                         ids=["kind", "epoch", "round"])
def test_a_rank_at_another_exchange_is_an_error_on_every_rank(theirs):
    world = 3
    mine = "'costs' of epoch 1, round 5"
    other = f"'{theirs[0]}' of epoch {theirs[1]}, round {theirs[2]}"
    results = run_world(_out_of_step, world, theirs, timeout=60)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} accepted a peer at {other} while at {mine}"
        name, text = result
        assert name == "ODBSyncError"
        if rank < world - 1:
            expect = f"rank {rank} is in exchange {mine} while rank {world - 1} is in {other}"
        else:  # the odd rank sees rank 0 as the first that differs
            expect = f"rank {rank} is in exchange {other} while rank 0 is in {mine}"
        assert f"ODB ranks are out of step: {expect}" in text, text


def _departures(rank, world, leaving):
    from odb_factory.comm.channel import Departure, PeerDeparted, SyncChannel
    sync = SyncChannel.create(timeout_s=30.0)
    sync.all_gather(rank, "status", 0, 0)  # a common exchange first
    if rank in leaving:
        reason, last_step, message = leaving[rank]
        sync.announce_departure(Departure(rank, 0, reason, last_step, message), "departure notice")
        return "announced"
    try:
        sync.all_gather(rank, "costs", 0, 1)
    except PeerDeparted as exc:
        return [(d.rank, d.reason, d.last_step) for d in exc.departures], exc.failed, exc.last_step, str(exc)
    return "no error"


@pytest.mark.slow
def test_a_departure_reaches_its_peer_as_peer_departed_naming_the_rank():
    results = run_world(_departures, 2, {1: ("left", 6, "")}, timeout=60)
    assert results[1] == "announced"
    departures, failed, last_step, text = results[0]
    assert departures == [(1, "left", 6)] and not failed and last_step == 6
    assert text == ("ODB on rank 0: rank 1 stopped iterating epoch 0 after step 6 "
                    "(learned in exchange 'costs' of epoch 0, round 1)")


@pytest.mark.slow
def test_departures_of_several_ranks_reach_every_peer_in_one_exchange():
    world = 4
    leaving = {1: ("failed", 3, "ValueError: cannot decode image 17"), 3: ("left", 5, "")}
    results = run_world(_departures, world, leaving, timeout=60)
    assert results[1] == results[3] == "announced"
    for rank in (0, 2):
        departures, failed, last_step, text = results[rank]
        assert departures == [(1, "failed", 3), (3, "left", 5)]
        assert failed and last_step == 3
        assert text.startswith(f"ODB on rank {rank}: rank 1 failed in epoch 0: ValueError: cannot decode "
                               "image 17; rank 3 stopped iterating epoch 0 after step 5")


def _absent_peer(rank, world, departing):
    import time

    from odb_factory.comm import ODBSyncError, SyncChannel
    from odb_factory.comm.channel import Departure
    sync = SyncChannel.create(timeout_s=1.5)
    if rank == 1:
        time.sleep(2.5)  # never enters the exchange
        return None
    try:
        if departing:  # a departure is an exchange of its own: round -1 of its epoch
            sync.announce_departure(Departure(0, 4, "left", 2), "costs")
        else:
            sync.all_gather("x", "costs", epoch=4, round=7)
    except ODBSyncError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("departing,where", [(False, "epoch 4, round 7"), (True, "epoch 4, round -1")])
def test_an_absent_peer_times_out_with_an_error_naming_rank_epoch_and_round(departing, where):
    text = run_world(_absent_peer, 2, departing, timeout=60)[0]
    assert text.startswith(f"ODB alignment exchange 'costs' failed on rank 0/2 ({where}) after "), text
    assert 1.0 <= reported_wait_s(text) < 30.0, text  # the wait it did
    assert (". Another rank probably failed or stopped iterating at a different step (see its log); if ranks "
            "are only slow, raise ODBConfig.sync_timeout_s Rank(s) [1] never entered this exchange") in text, text
    assert "timeout 2s" in text and "raise ODBConfig.sync_timeout_s" in text
    assert "timed out" in text.lower(), "the channel's own timeout ended the wait (not the peer's exit)"


def _silent_peer(rank, world):
    """Rank 2 goes silent (as a SIGSTOPped process) after the first exchange."""
    import time

    from odb_factory.comm import ODBSyncError, SyncChannel
    sync = SyncChannel.create(timeout_s=2.0)
    sync.all_gather(rank, "status", epoch=0, round=0)
    if rank == 2:
        time.sleep(4.0)
        return None
    try:
        sync.all_gather(rank, "costs", epoch=0, round=1)
    except ODBSyncError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_timeout_names_the_rank_that_went_silent_not_only_the_one_that_noticed():
    results = run_world(_silent_peer, 3, timeout=60)
    for rank in (0, 1):
        assert results[rank].startswith(f"ODB alignment exchange 'costs' failed on rank {rank}/3 "), results[rank]
        assert results[rank].endswith("Rank(s) [2] never entered this exchange (number 2 of this channel): "
                                      "stopped, hung or busy elsewhere for the whole timeout"), results[rank]
