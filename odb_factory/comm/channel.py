"""The side channel the ranks align over: a dedicated Gloo group, never the training one.

Every call has a timeout and failures name the rank, the epoch/round and what was being
exchanged. Outside torch.distributed (or with world size 1) the channel is local.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Optional

import torch.distributed as dist

from .errors import ODBSyncError
from .gather import gather_objects


class SyncChannel:
    def __init__(self, group: Optional[Any], rank: int, world_size: int, timeout_s: float):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

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
        return cls(group, rank, world, timeout_s)

    def all_gather(self, obj: Any, what: str, epoch: int = -1, round: int = -1) -> List[Any]:
        if self.group is None:
            return [obj]
        return gather_objects(
            obj, self.group, what, f"epoch {epoch}, round {round}", self.timeout_s,
            kind="ODB alignment exchange",
            hint="Another rank probably failed or stopped iterating at a different step (see "
                 "its log); if ranks are only slow, raise ODBConfig.sync_timeout_s")
