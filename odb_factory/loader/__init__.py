"""Mechanism: processes, queues and collectives around the pure planner."""

from .batch import ODBBatch
from .loader import ODBDataLoader

__all__ = ["ODBBatch", "ODBDataLoader"]
