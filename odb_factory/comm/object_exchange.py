"""Moving pre-collate samples between ranks over the side Gloo channel.

Gloo has no all-to-all for arbitrary objects on CPU, so: one all-gather of the byte sizes
each rank sends to each rank, then point-to-point sends/receives of pickled payloads.
Every rank takes part in the size exchange even when it sends and receives nothing.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, List, Sequence, Tuple

import torch
import torch.distributed as dist

from .channel import SyncChannel
from .errors import ODBSyncError, describe_failure


def exchange_objects(sync: SyncChannel, outgoing: Sequence[List[Any]], what: str, epoch: int,
                     round: int) -> Tuple[List[List[Any]], List[int]]:
    """outgoing[d] = objects for rank d. Returns (incoming[s] = objects from rank s, bytes
    this rank sent to each rank)."""
    me, world = sync.rank, sync.world_size
    if sync.group is None:  # a channel has a group exactly when it spans several ranks
        return [list(outgoing[0])], [0]
    payloads = [pickle.dumps(list(items)) if d != me and items else b""  # the default protocol: 5
                for d, items in enumerate(outgoing)]
    sent = [len(p) for p in payloads]
    matrix = sync.all_gather(sent, f"{what} sizes", epoch, round)  # matrix[s][d]
    start = time.monotonic()
    requests, buffers = [], {}
    try:
        for src in range(world):
            size = matrix[src][me]
            if src != me and size:
                # a wider dtype would receive the same bytes into a larger buffer (pickle stops at
                # its STOP opcode): only memory would tell
                buffers[src] = torch.empty(size, dtype=torch.uint8)  # pragma: no mutate, see above
                requests.append(dist.irecv(buffers[src], src=src, group=sync.group))
        for dst in range(world):
            if dst != me and sent[dst]:
                tensor = torch.frombuffer(bytearray(payloads[dst]), dtype=torch.uint8)
                requests.append(dist.isend(tensor, dst=dst, group=sync.group))
        for request in requests:
            request.wait()
    except Exception as exc:
        raise ODBSyncError(describe_failure(
            "ODB sample exchange", what, me, world, f"epoch {epoch}, round {round}",
            time.monotonic() - start, sync.timeout_s, exc, "Another rank probably failed; see its log")) from exc
    incoming: List[List[Any]] = [[] for _ in range(world)]
    incoming[me] = list(outgoing[me])
    for src, buffer in buffers.items():
        incoming[src] = pickle.loads(buffer.numpy().tobytes())
    return incoming, sent
