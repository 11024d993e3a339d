"""gather_objects / group_rank_world: the object all-gather every ODB collective builds on,
on real gloo ranks, and its rank-naming errors."""

from __future__ import annotations

import pytest

from odb_factory.comm import ODBExchangeError, ODBSyncError, gather_objects, group_rank_world
from tests.helpers.distributed import reported_wait_s, run_world


def test_outside_torch_distributed_everything_is_local():
    obj = {"tokens": [1, 2, 3]}
    assert group_rank_world(None) == (0, 1)
    out = gather_objects(obj, None, "metadata", "step 0", 1.0)
    assert out == [obj] and out[0] is obj


def _gather_rank(rank, world):
    import torch.distributed as dist

    from odb_factory.comm import gather_objects, group_rank_world
    everyone = gather_objects({"rank": rank, "items": list(range(rank))}, None, "metadata", "step 0", 30)
    # a subgroup of the odd ranks numbers its members from 0
    odd = dist.new_group(ranks=[r for r in range(world) if r % 2], backend="gloo")
    sub = None
    if rank % 2:
        sub = (group_rank_world(odd), gather_objects(("odd", rank), odd, "odd", "step 0", 30))
    return group_rank_world(None), everyone, sub


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_every_object_in_rank_order(world):
    results = run_world(_gather_rank, world, timeout=60)
    expected = [{"rank": r, "items": list(range(r))} for r in range(world)]
    for rank, (where, everyone, sub) in enumerate(results):
        assert where == (rank, world)
        assert everyone == expected
        if rank % 2:
            odd = [r for r in range(world) if r % 2]
            assert sub == ((odd.index(rank), len(odd)), [("odd", r) for r in odd])
        else:
            assert sub is None


def _absent_peer(rank, world):
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from odb_factory.comm import errors, gather_objects
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1.5))
    if rank == world - 1:
        time.sleep(2.5)  # never enters the exchange (its peers give up after 1.5s)
        return None
    # rank 0: the default error type, kind and hint; rank 1 its own
    options = dict(kind="ODB probe", hint="Look at the last rank.", error=errors.ODBExchangeError) if rank == 1 else {}
    try:
        gather_objects({"rank": rank}, group, "metadata", "epoch 3, round 7", 1.5, **options)
    except errors.ODBSyncError as exc:
        return type(exc).__name__, str(exc), type(exc.__cause__).__name__
    return "no error"


@pytest.mark.slow
def test_an_absent_peer_times_out_with_an_error_naming_rank_and_round():
    world = 3
    results = run_world(_absent_peer, world, timeout=60)
    assert results[-1] is None
    for rank, error, kind, hint in [(0, ODBSyncError, "ODB exchange", "Another rank probably failed; see its log"),
                                    (1, ODBExchangeError, "ODB probe", "Look at the last rank.")]:
        name, text, cause = results[rank]
        assert name == error.__name__                      # the caller's error type
        assert text.startswith(f"{kind} 'metadata' failed on rank {rank}/{world} (epoch 3, round 7) after ")
        assert "timeout 2s" in text and text.endswith(hint)
        assert 1.0 <= reported_wait_s(text) < 30.0, text  # the wait it did
        assert cause != "NoneType"                          # the collective's own error is chained
        assert "timed out" in text.lower(), "the group's timeout ended the wait (not the peer's exit)"
