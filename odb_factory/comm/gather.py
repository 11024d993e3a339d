"""The object all-gather every ODB collective is built on, with rank-naming errors."""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional

import torch.distributed as dist

from .errors import ODBSyncError, describe_failure


def group_rank_world(group: Optional[Any]) -> tuple:
    """(rank in group, group size); (0, 1) outside torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def gather_objects(obj: Any, group: Optional[Any], what: str, where: str, timeout_s: float,
                   kind: str = "ODB exchange", hint: str = "Another rank probably failed; see its log",
                   error: Callable[[str], ODBSyncError] = ODBSyncError) -> List[Any]:
    """`all_gather_object` of small metadata; a failure raises `error` naming this rank,
    `what` was exchanged and `where` (epoch/round or step)."""
    rank, world = group_rank_world(group)
    if world == 1:
        return [obj]
    out: List[Any] = [None] * world
    start = time.monotonic()
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as exc:
        raise error(describe_failure(kind, what, rank, world, where, time.monotonic() - start,
                                     timeout_s, exc, hint)) from exc
    return out
