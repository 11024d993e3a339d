"""The error types every exchange raises, and the one message format they share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odb_factory.comm import ODBExchangeError, ODBSyncError
from odb_factory.comm.errors import describe_failure


def test_error_hierarchy():
    # callers catch ODBSyncError for every cross-rank failure, RuntimeError for anything
    assert issubclass(ODBSyncError, RuntimeError)
    assert issubclass(ODBExchangeError, ODBSyncError)
    with pytest.raises(ODBSyncError):
        raise ODBExchangeError("x")


def test_describe_failure_hand_value():
    text = describe_failure("ODB exchange", "vision rows", 3, 8, "step 12", 1.26, 600.0,
                            TimeoutError("no reply"), "See rank 5's log")
    assert text == ("ODB exchange 'vision rows' failed on rank 3/8 (step 12) after 1.3s, "
                    "timeout 600s: no reply. See rank 5's log")


@given(rank=st.integers(0, 511), world=st.integers(1, 512), what=st.text(min_size=1, max_size=20),
       where=st.sampled_from(["step 0", "epoch 2, round 9", "epoch -1, round -1"]),
       elapsed=st.floats(0, 1e5, allow_nan=False), timeout=st.floats(0.5, 1e5, allow_nan=False))
def test_describe_failure_names_every_part(rank, world, what, where, elapsed, timeout):
    text = describe_failure("ODB alignment exchange", what, rank, world, where, elapsed, timeout,
                            ValueError("cause"), "hint.")
    assert text.startswith(f"ODB alignment exchange '{what}' failed on rank {rank}/{world} ({where}) after ")
    assert f"timeout {timeout:.0f}s: cause. hint." in text
