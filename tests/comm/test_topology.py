"""ranks_per_node: an explicit value wins, else torchrun's LOCAL_WORLD_SIZE, else one node."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odb_factory.comm.topology import ranks_per_node


@pytest.fixture
def no_local_world(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def test_every_rank_on_one_node_without_explicit_value_or_torchrun(no_local_world):
    assert ranks_per_node(None, 8) == 8
    assert ranks_per_node(None, 1) == 1


def test_torchrun_local_world_size_is_read(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(None, 16) == 4


def test_explicit_value_beats_torchrun(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(2, 16) == 2


def test_zero_counts_as_not_given(monkeypatch):
    # `explicit or ...`: 0 (as an unset config field might carry) is not a node size
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert ranks_per_node(0, 6) == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_node(0, 6) == 6


@given(explicit=st.one_of(st.none(), st.integers(1, 64)), world=st.integers(1, 1024),
       local=st.one_of(st.none(), st.integers(1, 64)))
def test_precedence_explicit_then_environment_then_world(explicit, world, local):
    with pytest.MonkeyPatch.context() as mp:
        if local is None:
            mp.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            mp.setenv("LOCAL_WORLD_SIZE", str(local))
        got = ranks_per_node(explicit, world)
    want = explicit if explicit is not None else (local if local is not None else world)
    assert got == want
    assert isinstance(got, int)
