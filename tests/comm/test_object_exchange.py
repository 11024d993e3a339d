"""exchange_objects: pre-collate samples move between real gloo ranks; a ledger of ids checks
that each lands on its destination, in order, once, and that the byte counts are the pickles'."""

from __future__ import annotations

import pytest

from odb_factory.comm import SyncChannel
from odb_factory.comm.object_exchange import exchange_objects
from tests.helpers.distributed import reported_wait_s, run_world


def test_one_process_keeps_its_own_objects():
    items = [{"id": 1}, {"id": 2}]
    incoming, sent = exchange_objects(SyncChannel(None, 0, 1, 5.0), [items], "balance", 0, 0)
    assert incoming == [items] and incoming[0] is not items and incoming[0][0] is items[0]
    assert sent == [0]


def counts(world, round):
    """counts[s][d]: objects rank s sends rank d. Rank 0 sends nothing, the last rank receives
    nothing; a few other blocks are empty too."""
    c = [[(3 * s + 5 * d + 7 * round) % 4 for d in range(world)] for s in range(world)]
    for d in range(world):
        c[0][d] = 0
    for s in range(world):
        c[s][world - 1] = 0
    return c


def item(src, dst, k, round):
    return {"id": (round, src, dst, k), "tokens": list(range(k + 3 * src)), "path": f"img/{src}-{dst}-{k}.png"}


def _exchange_rank(rank, world, rounds):
    import pickle

    from odb_factory.comm import SyncChannel
    from odb_factory.comm.object_exchange import exchange_objects
    sync = SyncChannel.create(timeout_s=30.0)
    out = []
    for round in range(rounds):
        c = counts(world, round)
        outgoing = [[item(rank, d, k, round) for k in range(c[rank][d])] for d in range(world)]
        incoming, sent = exchange_objects(sync, outgoing, "balance", epoch=2, round=round)
        kept = all(a is b for a, b in zip(incoming[rank], outgoing[rank]))  # no pickling of its own
        expected_bytes = [len(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)) if d != rank and items else 0
                          for d, items in enumerate(outgoing)]
        out.append((incoming, sent, expected_bytes, kept))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_object_reaches_its_destination_once(world):
    rounds = 2
    results = run_world(_exchange_rank, world, rounds, timeout=60)
    for round in range(rounds):
        c = counts(world, round)
        received = []
        for rank, per_round in enumerate(results):
            incoming, sent, expected_bytes, kept = per_round[round]
            assert kept
            assert len(incoming) == world
            for src in range(world):
                # from each source: exactly what it sent here, in its order
                assert incoming[src] == [item(src, rank, k, round) for k in range(c[src][rank])]
                received += [(rank, obj["id"]) for obj in incoming[src]]
            assert sent == expected_bytes
            assert sent[rank] == 0
        ledger = [(dst, (round, src, dst, k)) for src in range(world) for dst in range(world)
                  for k in range(c[src][dst])]
        assert sorted(received) == sorted(ledger)            # nothing lost, nothing duplicated
        assert len(set(received)) == len(received)
        assert any(c[s][d] for s in range(world) for d in range(world) if s != d), "objects actually moved"


def _sender_vanishes(rank, world):
    import time

    from odb_factory.comm import ODBSyncError, SyncChannel
    from odb_factory.comm.object_exchange import exchange_objects
    sync = SyncChannel.create(timeout_s=1.5)
    if rank == 1:
        # announces 100 bytes for rank 0 in the size exchange, then never sends them
        sync.all_gather([100, 0], "balance sizes", 1, 2)
        time.sleep(2.5)
        return None
    try:
        exchange_objects(sync, [[], []], "balance", epoch=1, round=2)
    except ODBSyncError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_missing_payload_times_out_with_an_error_naming_rank_epoch_and_round():
    text = run_world(_sender_vanishes, 2, timeout=60)[0]
    assert text.startswith("ODB sample exchange 'balance' failed on rank 0/2 (epoch 1, round 2) after "), text
    assert "timeout 2s" in text and "timed out" in text.lower()
    assert 1.0 <= reported_wait_s(text) < 30.0, text  # the wait it did
    assert text.endswith(". Another rank probably failed; see its log"), text
