"""What every encoder stage's plan shares: items that enter the tower as blocks of input rows
on their encoding rank and come back as blocks of output rows to the rank that owns them.

A stage plan (``VisionPlan``: images and videos; ``AudioPlan``: audio clips) says, per owner
rank, the encoding rank of each of its items (``encoder``) and, per encoding rank, its
*share*: the ``(owner, position)`` pairs it encodes, sorted. Subclasses define an item's
sizes (``in_rows``, ``out_rows``) and the bytes of one row each way; everything else (who
sends how many rows to whom, the row permutations, the balance metrics) is here.

Orders (the contract with the mechanisms in ``odb_factory.encoder_stage``):

* the tower of encoding rank ``d`` runs on its share in share order (owner, then position);
* owner ``r`` sends its input blocks grouped by encoding rank, each group in position order,
  so rank ``d`` receives exactly its share order (sources arrive in rank order);
* rank ``d`` returns its share's output rows in share order, grouped by owner; owner ``r``
  receives them grouped by encoding rank, and ``return_rows`` is the row permutation that
  restores local order (the inverse of the send permutation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .assignment import balance


def block_rows(sizes: Sequence[int], order: Sequence[int]) -> np.ndarray:
    """Row indices that list the blocks ``order`` (block ids) of a buffer whose blocks, in
    id order, have ``sizes`` rows."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
    if not len(order):
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(starts[b], starts[b + 1], dtype=np.int64) for b in order])


class EncoderPlan:
    """Row bookkeeping and metrics of one encoder stage's plan (see module doc).

    Subclasses are frozen dataclasses with the fields ``encoder``, ``shares``,
    ``cost_before``, ``cost_after``, ``lower_bound`` and the methods ``items(owner)``,
    ``in_rows(owner, pos)``, ``out_rows(owner, pos)``, ``in_row_bytes``, ``out_row_bytes``.
    """

    encoder: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[tuple[int, int], ...], ...]
    cost_before: tuple[float, ...]
    cost_after: tuple[float, ...]
    lower_bound: float

    def in_rows(self, owner: int, pos: int) -> int:
        raise NotImplementedError

    def out_rows(self, owner: int, pos: int) -> int:
        raise NotImplementedError

    @property
    def in_row_bytes(self) -> int:
        raise NotImplementedError

    @property
    def out_row_bytes(self) -> int:
        raise NotImplementedError

    # ---- sizes -------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return len(self.encoder)

    @property
    def num_items(self) -> int:
        return sum(len(e) for e in self.encoder)

    # ---- encoding side -----------------------------------------------------------------
    def input_recv_counts(self, rank: int) -> list[int]:
        """Input rows encoding rank ``rank`` receives from each owner (share order)."""
        out = [0] * self.world
        for o, p in self.shares[rank]:
            out[o] += self.in_rows(o, p)
        return out

    def output_send_counts(self, rank: int) -> list[int]:
        """Output rows encoding rank ``rank`` returns to each owner (share order)."""
        out = [0] * self.world
        for o, p in self.shares[rank]:
            out[o] += self.out_rows(o, p)
        return out

    # ---- owner side --------------------------------------------------------------------
    def send_order(self, rank: int) -> list[int]:
        """Local item positions of owner ``rank`` in the order their inputs are sent
        (grouped by encoding rank, each group in position order); outputs come back in
        this order too."""
        enc = self.encoder[rank]
        return sorted(range(len(enc)), key=lambda i: (enc[i], i))

    def input_send_counts(self, rank: int) -> list[int]:
        out = [0] * self.world
        for i, d in enumerate(self.encoder[rank]):
            out[d] += self.in_rows(rank, i)
        return out

    def input_send_rows(self, rank: int) -> np.ndarray:
        """Row index into the owner's input rows that puts them in send order."""
        sizes = [self.in_rows(rank, i) for i in range(len(self.encoder[rank]))]
        return block_rows(sizes, self.send_order(rank))

    def output_recv_counts(self, rank: int) -> list[int]:
        out = [0] * self.world
        for i, d in enumerate(self.encoder[rank]):
            out[d] += self.out_rows(rank, i)
        return out

    def return_rows(self, rank: int) -> np.ndarray:
        """Row index into the received output buffer that restores local item order."""
        arrival = self.send_order(rank)
        block_of = {pos: b for b, pos in enumerate(arrival)}
        sizes = [self.out_rows(rank, pos) for pos in arrival]
        return block_rows(sizes, [block_of[i] for i in range(len(arrival))])

    def is_local(self, rank: int) -> bool:
        """True if owner ``rank`` keeps all its items and encodes nothing else."""
        return all(d == rank for d in self.encoder[rank]) and \
            all(o == rank for o, _ in self.shares[rank])

    # ---- metrics -----------------------------------------------------------------------
    @property
    def max_over_mean_before(self) -> float:
        return _ratio(max(self.cost_before), math.fsum(self.cost_before) / self.world)

    @property
    def max_over_mean_after(self) -> float:
        return _ratio(max(self.cost_after), math.fsum(self.cost_after) / self.world)

    @property
    def max_over_lb_before(self) -> float:
        return _ratio(max(self.cost_before), self.lower_bound)

    @property
    def max_over_lb_after(self) -> float:
        return _ratio(max(self.cost_after), self.lower_bound)

    @property
    def moved_items(self) -> list[tuple[int, int, int]]:
        """(owner, position, encoding rank) of every item encoded away from its owner."""
        return [(r, i, d) for r, enc in enumerate(self.encoder) for i, d in enumerate(enc)
                if d != r]

    @property
    def input_bytes_moved(self) -> int:
        return sum(self.in_rows(r, i) for r, i, _ in self.moved_items) * self.in_row_bytes

    @property
    def output_bytes_moved(self) -> int:
        """Forward output bytes; backward moves as many gradient bytes again."""
        return sum(self.out_rows(r, i) for r, i, _ in self.moved_items) * self.out_row_bytes

    def balance_summary(self) -> dict:
        return {
            "items": self.num_items, "moved_items": len(self.moved_items),
            "cost_before": list(self.cost_before), "cost_after": list(self.cost_after),
            "lower_bound": self.lower_bound,
            "max_over_mean_before": self.max_over_mean_before,
            "max_over_mean_after": self.max_over_mean_after,
            "max_over_lb_before": self.max_over_lb_before,
            "max_over_lb_after": self.max_over_lb_after,
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 1.0


def shares_and_costs(encoder: Sequence[Sequence[int]], costs: Sequence[Sequence[float]]
                     ) -> dict:
    """The fields every plan derives from an assignment: each encoding rank's sorted share,
    the per-rank cost before (own items) and after (share), and the lower bound
    ``max(total / ranks, largest item)``."""
    world = len(encoder)
    shares: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for r, enc in enumerate(encoder):
        for i, d in enumerate(enc):
            shares[d].append((r, i))
    for share in shares:
        share.sort()
    flat = [c for cs in costs for c in cs]
    return {
        "encoder": tuple(tuple(e) for e in encoder),
        "shares": tuple(tuple(s) for s in shares),
        "cost_before": tuple(math.fsum(c) for c in costs),
        "cost_after": tuple(math.fsum(costs[o][p] for o, p in s) for s in shares),
        "lower_bound": max(math.fsum(flat) / world, max(flat)) if flat else 0.0,
    }


def assign_items(costs: Sequence[Sequence[float]], sizes: Sequence[Sequence[float]], *,
                 ranks_per_node: int, mode: str, tolerance: float | None,
                 placement: str | None) -> list[list[int]]:
    """Encoding rank of every item (per owner, local order) from ``balance``: ``costs`` are
    the items' stage costs, ``sizes`` the bytes they cost to move (the placement keeps the
    most bytes where they are). When the plan would not lower the slowest rank's cost (LPT
    can land above a layout that happens to be good), every item stays with its owner."""
    bp = balance(costs, ranks_per_node=ranks_per_node, mode=mode, sizes_per_rank=sizes,
                 tolerance=tolerance, placement=placement)
    enc = [[-1] * len(c) for c in costs]
    for d, dest in enumerate(bp.destinations):
        for r, i in dest:
            enc[r][i] = d
    after = [0.0] * len(costs)
    for r, e in enumerate(enc):
        for i, d in enumerate(e):
            after[d] += costs[r][i]
    if max(after, default=0.0) >= max((math.fsum(c) for c in costs), default=0.0):
        return [[r] * len(c) for r, c in enumerate(costs)]
    return enc
