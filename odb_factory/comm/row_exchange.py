"""Differentiable variable-size all-to-all of tensor rows over a torch.distributed group.

``all_to_all_rows(x, send_counts, recv_counts, group)`` is ``all_to_all_single`` with split
sizes, for any backend that has point-to-point ops: rank ``r`` sends rows
``x[sum(send_counts[:d]) : sum(send_counts[:d + 1])]`` to rank ``d`` and returns the rows it
receives, concatenated in source-rank order. Gloo has no ``all_to_all`` on CPU, so the
transfer is one ``batch_isend_irecv`` of the non-empty blocks (the rank's own block is a
local copy). Zero-row blocks are never sent: both ends know the counts, so they agree.

Autograd: backward is the reverse exchange (the gradient of each received block goes back
to the rank that sent the block), so the function is its own adjoint and moves every row
exactly once each way -- no sums, hence no rounding. Every rank of the group must call it
the same number of times in the same order, also with zero rows to send or receive, and
(for the backward) every rank's output must reach its loss; see docs/encoder_balancing.md.

Errors: every failure or timeout is an ``ODBExchangeError`` (an ``ODBSyncError``) naming
the rank, the exchange and the step (``comm/errors.py``). Outside torch.distributed (or
with one rank) everything is local.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import ODBExchangeError, describe_failure
from .gather import group_rank_world

DEFAULT_TIMEOUT_S = 600.0
HINT = ("Another rank probably failed or took a different code path (every rank must enter "
        "every exchange, also with nothing to send); see its log")


def _fail(what: str, rank: int, world: int, step: int, start: float, timeout_s: float,
          exc: BaseException) -> ODBExchangeError:
    return ODBExchangeError(describe_failure("ODB exchange", what, rank, world, f"step {step}",
                                             time.monotonic() - start, timeout_s, exc, HINT))


def _comm_device(group: Any | None, like: torch.device) -> torch.device:
    """Where tensors must live for this group's backend: CPU for gloo, else ``like``."""
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cpu") if "gloo" in backend and "nccl" not in backend else like


def _counts(values: Sequence[int], world: int, name: str, rank: int) -> list[int]:
    out = [int(v) for v in values]
    if len(out) != world or any(v < 0 for v in out):
        raise ValueError(f"rank {rank}: {name} must list {world} non-negative row counts, "
                         f"got {list(values)!r}")
    return out


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any | None,
              what: str, step: int, timeout_s: float) -> torch.Tensor:
    """The transfer itself (no autograd): rows of x by destination -> rows by source."""
    rank, world = group_rank_world(group)
    if world == 1:
        return x.clone()
    dev = _comm_device(group, x.device)
    xs = x.detach().contiguous()
    if xs.device != dev:
        xs = xs.to(dev)
    out = torch.empty((sum(recv),) + tuple(x.shape[1:]), dtype=x.dtype, device=dev)
    send_blocks = xs.split(send)
    recv_blocks = out.split(recv)  # row blocks of a contiguous tensor: contiguous views
    if send[rank]:
        recv_blocks[rank].copy_(send_blocks[rank])
    ops = []
    for peer in range(world):
        if peer == rank:
            continue
        if send[peer]:
            ops.append(dist.P2POp(dist.isend, send_blocks[peer], group=group, group_peer=peer))
        if recv[peer]:
            ops.append(dist.P2POp(dist.irecv, recv_blocks[peer], group=group, group_peer=peer))
    if ops:
        start = time.monotonic()
        try:
            works = dist.batch_isend_irecv(ops)
            for w in works:
                w.wait(timedelta(seconds=timeout_s))
        except Exception as exc:
            raise _fail(what, rank, world, step, start, timeout_s, exc) from exc
    return out if out.device == x.device else out.to(x.device)


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group, what, step, timeout_s):
        ctx.args = (send, recv, group, what, step, timeout_s)
        return _exchange(x, send, recv, group, what, step, timeout_s)

    @staticmethod
    def backward(ctx, grad_out):
        send, recv, group, what, step, timeout_s = ctx.args
        grad_x = _exchange(grad_out, recv, send, group, f"{what} (backward)", step, timeout_s)
        return grad_x, None, None, None, None, None, None


def all_to_all_rows(x: torch.Tensor, send_counts: Sequence[int],
                    recv_counts: Sequence[int] | None = None, group: Any | None = None,
                    *, what: str = "rows", step: int = -1,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """Send ``send_counts[d]`` consecutive rows of ``x`` to rank ``d``; return the rows
    received, in source-rank order (``recv_counts[s]`` rows from rank ``s``).

    ``recv_counts=None`` learns them with one all-gather of the send counts. Differentiable
    in ``x`` (backward = reverse exchange) when ``x`` requires grad. ``x`` must have the same
    trailing shape and dtype on every rank (a rank with nothing to send passes a 0-row
    tensor of that shape). A collective: every rank of ``group`` must call it.
    """
    rank, world = group_rank_world(group)
    send = _counts(send_counts, world, "send_counts", rank)
    if x.dim() < 1 or x.shape[0] != sum(send):
        raise ValueError(f"rank {rank}: exchange '{what}': x has {x.shape[0] if x.dim() else 0} "
                         f"rows but send_counts sum to {sum(send)}")
    if recv_counts is None:
        if world == 1:
            recv = send  # pragma: no mutate, one rank: _exchange returns a copy, reading no counts
        else:
            dev = _comm_device(group, x.device)
            mine = torch.tensor(send, device=dev)  # Python ints: int64
            every = [torch.empty_like(mine) for _ in range(world)]
            start = time.monotonic()
            try:
                dist.all_gather(every, mine, group=group)
            except Exception as exc:
                raise _fail(f"{what} (row counts)", rank, world, step, start, timeout_s,
                            exc) from exc
            recv = [int(t[rank]) for t in every]
    else:
        recv = _counts(recv_counts, world, "recv_counts", rank)
    # autograd records the backward only where x requires grad and grad is enabled
    return _AllToAllRows.apply(x, send, recv, group, what, step, timeout_s)
