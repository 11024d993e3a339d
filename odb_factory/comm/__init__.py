"""Every collective ODB runs, and its error types, in one place.

* ``channel``: ``SyncChannel``, the dedicated Gloo group the loader aligns over;
* ``gather``: the object all-gather the others build on;
* ``object_exchange``: pre-collate samples between ranks (post-balancing);
* ``row_exchange``: differentiable variable-size all-to-all of tensor rows (encoder stage).
"""

from .channel import SyncChannel
from .errors import ODBExchangeError, ODBSyncError
from .gather import gather_objects, group_rank_world

__all__ = ["ODBExchangeError", "ODBSyncError", "SyncChannel", "gather_objects", "group_rank_world"]
