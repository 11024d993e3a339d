"""Where ranks live: how many share a node."""

from __future__ import annotations

import os
from typing import Optional


def ranks_per_node(explicit: Optional[int], world_size: int) -> int:
    """`explicit` if given, else torchrun's LOCAL_WORLD_SIZE, else every rank on one node."""
    return explicit or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
