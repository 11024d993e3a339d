"""The side channel the ranks align over: a dedicated Gloo group, never the training one.

Every exchange travels in an envelope saying what it is (kind, epoch, round): ranks that
are not at the same point of the protocol get an error naming both sides at once, never a
silent mismatch. A rank that stops (its trainer left the epoch, or its pipeline failed)
sends a `Departure` in place of its next exchange, so every peer learns it within that
exchange instead of waiting for the timeout. Every call has a timeout and failures name
the rank, the epoch/round and what was being exchanged. Outside torch.distributed (or with
world size 1) the channel is local.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Optional, Sequence

import torch.distributed as dist

from . import exit_grace
from .errors import ODBSyncError
from .gather import gather_objects


@dataclass(frozen=True)
class Envelope:
    what: str
    epoch: int
    round: int
    payload: Any

    def where(self) -> str:
        return f"'{self.what}' of epoch {self.epoch}, round {self.round}"


@dataclass(frozen=True)
class Departure:
    """Sent by a rank that leaves the epoch's protocol early.

    reason: "left" (its trainer stopped iterating) or "failed" (its pipeline raised).
    last_step: the last step its trainer received (-1: none).
    """
    rank: int
    epoch: int
    reason: str
    last_step: int
    message: str = ""


class PeerDeparted(ODBSyncError):
    """Some peers sent a Departure in this exchange (`asked_for`: the step this rank's
    trainer asked for after a peer had left)."""

    def __init__(self, departures: Sequence[Departure], what: str, rank: int,
                 asked_for: Optional[int] = None):
        self.departures, self.what, self.rank = list(departures), what, rank
        parts = []
        for d in self.departures:
            if d.reason == "failed":
                parts.append(f"rank {d.rank} failed in epoch {d.epoch}: {d.message}")
            else:
                parts.append(f"rank {d.rank} stopped iterating epoch {d.epoch} after step {d.last_step}")
        message = f"ODB on rank {rank}: " + "; ".join(parts) + f" (learned in exchange {what})"
        if asked_for is not None:
            message += (f"; this rank asked for step {asked_for} of that epoch: every rank must "
                        "leave an epoch at the same step")
        super().__init__(message)

    @property
    def failed(self) -> bool:
        return any(d.reason == "failed" for d in self.departures)

    @property
    def last_step(self) -> int:
        """Steps up to this one are still common to every rank."""
        return min(d.last_step for d in self.departures)


def _arrivals_store(group: Any) -> Optional[Any]:
    """The default process group's store (private in torch 2.14: upstream_contract.py), or None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store() if getattr(group, "group_name", None) is not None else None
    except (ImportError, RuntimeError):
        return None


class SyncChannel:
    def __init__(self, group: Optional[Any], rank: int, world_size: int, timeout_s: float,
                 store: Optional[Any] = None):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        # the process group's key-value store: each rank counts the exchanges it entered there,
        # so a rank that times out can name the peers that never arrived (None: not named)
        self.store = store
        self.entered = 0

    @classmethod
    def create(cls, timeout_s: float) -> "SyncChannel":
        """Join the current process group's ranks in a new Gloo group (a collective over
        the default group: every rank must construct its ODB loaders in the same order)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, 1, timeout_s)
        rank, world = dist.get_rank(), dist.get_world_size()
        if world == 1:
            return cls(None, 0, 1, timeout_s)
        try:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        except Exception as exc:  # never train unsynchronised
            raise ODBSyncError(
                f"rank {rank}: cannot create the ODB alignment channel (a Gloo group over "
                f"{world} ranks): {exc}. ODB refuses to run without it; check that torch "
                f"was built with Gloo and that MASTER_ADDR/MASTER_PORT reach every rank") from exc
        exit_grace.install()  # a Gloo group's last collective must not abort the exit
        return cls(group, rank, world, timeout_s, store=_arrivals_store(group))

    def all_gather(self, obj: Any, what: str, epoch: int = -1, round: int = -1) -> List[Any]:
        """Every rank's `obj`. Raises PeerDeparted when a peer left instead, and
        ODBSyncError naming both sides when a peer is at another exchange."""
        if self.group is None:
            return [obj]
        mine = Envelope(what, epoch, round, obj)
        every = self._gather(mine, what, epoch, round)
        departed = [e for e in every if isinstance(e, Departure)]
        if departed:
            raise PeerDeparted(departed, mine.where(), self.rank)
        for rank, theirs in enumerate(every):
            if (theirs.what, theirs.epoch, theirs.round) != (what, epoch, round):
                raise ODBSyncError(
                    f"ODB ranks are out of step: rank {self.rank} is in exchange {mine.where()} while "
                    f"rank {rank} is in {theirs.where()}. A rank left an epoch at another step than "
                    f"its peers or runs other planning options; every rank must iterate each epoch "
                    f"to the same step with the same ODBConfig")
        return [e.payload for e in every]

    def announce_departure(self, departure: Departure, what: str) -> None:
        """Take part in the peers' next exchange with a Departure instead of a payload."""
        if self.group is not None:
            self._gather(departure, what, departure.epoch, -1)

    def _gather(self, obj: Any, what: str, epoch: int, round: int) -> List[Any]:
        self.entered += 1
        if self.store is not None:
            self.store.add(self._arrivals_key(self.rank), 1)
        try:
            return gather_objects(
                obj, self.group, what, f"epoch {epoch}, round {round}", self.timeout_s,
                kind="ODB alignment exchange",
                hint="Another rank probably failed or stopped iterating at a different step (see "
                     "its log); if ranks are only slow, raise ODBConfig.sync_timeout_s")
        except ODBSyncError as exc:
            absent = self.absent_peers()
            if absent:
                raise ODBSyncError(f"{exc} Rank(s) {absent} never entered this exchange (number "
                                   f"{self.entered} of this channel): stopped, hung or busy "
                                   "elsewhere for the whole timeout") from exc
            raise

    def _arrivals_key(self, rank: int) -> str:
        return f"odb_factory/channel/{self.group.group_name}/entered/{rank}"

    def absent_peers(self) -> List[int]:
        """Ranks that have entered fewer of this channel's exchanges than this rank."""
        if self.store is None:
            return []
        try:
            entered = [int(self.store.add(self._arrivals_key(r), 0)) for r in range(self.world_size)]
        except Exception:  # the store went with the failure: nothing to add to the error
            return []
        return [r for r, count in enumerate(entered) if count < self.entered]
