"""Error types of every cross-rank exchange, and the one message format they share."""

from __future__ import annotations


class ODBSyncError(RuntimeError):
    """A collective between ranks failed or timed out."""


class ODBExchangeError(ODBSyncError):
    """A tensor exchange between ranks (the encoder stage) failed or timed out."""


def describe_failure(kind: str, what: str, rank: int, world: int, where: str, elapsed_s: float,
                     timeout_s: float, exc: BaseException, hint: str) -> str:
    """`kind 'what' failed on rank r/w (where) after Xs, timeout Ys: cause. hint`."""
    return (f"{kind} '{what}' failed on rank {rank}/{world} ({where}) after {elapsed_s:.1f}s, "
            f"timeout {timeout_s:.0f}s: {exc}. {hint}")
