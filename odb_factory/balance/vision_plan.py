"""Pure planning of the vision stage: which rank encodes which image, and the bookkeeping
to bring each embedding block back to the rank that holds its text.

Inputs are every rank's per-item grids ``(t, h, w)`` in local order (an *item* is an image
or a video: the vision tower treats both alike). The cost of an item is ``item_cost``:
``cost_model(h * w)`` per temporal slice (``= cost_model(t * h * w)`` for images, whose
``t`` is 1); ``odb_factory.balance.balance`` (LPT by default)
decides the vision rank of every item. Everything here is a deterministic function of
its arguments, so every rank computes the same plan from the same all-gathered grids.

Orders (the contract with ``odb_factory.encoder_stage.vision``):

* the *share* of vision rank ``d`` is the list of ``(owner, position)`` it encodes, sorted
  by owner then position; the tower runs on it in that order;
* owner ``r`` sends its pixel blocks grouped by destination rank, each group in position
  order -- so vision rank ``d`` receives exactly its share order (sources arrive in rank
  order);
* vision rank ``d`` returns the embedding rows of its share in share order, which is
  grouped by owner; owner ``r`` receives them grouped by vision rank, then
  ``arrival_order(r)`` says which local item each block is, and ``return_rows`` is the
  row permutation that restores local order (the inverse of the send permutation).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from odb_factory.balance import QWEN3_VL_VISION, StageCostModel, balance

Grid = tuple[int, int, int]
VISION_MODES = ("lpt", "min_move")


def _grid(value: object, merge: int, where: str) -> Grid:
    try:
        t, h, w = (v for v in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be a (t, h, w) triple, got {value!r}") from None
    out = []
    for name, v in (("t", t), ("h", h), ("w", w)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{where}: {name} must be an integer >= 1, got {v!r}")
        out.append(int(v))
    if out[1] % merge or out[2] % merge:
        raise ValueError(f"{where} = {tuple(out)}: h and w must be multiples of the spatial "
                         f"merge size {merge}")
    return out[0], out[1], out[2]


def _normalise(grids_per_rank: Sequence[Sequence[object]], merge: int
               ) -> tuple[tuple[Grid, ...], ...]:
    if isinstance(grids_per_rank, (str, bytes)) or not isinstance(grids_per_rank, Sequence):
        raise ValueError("grids_per_rank must be a list with one list of (t, h, w) per rank")
    if not grids_per_rank:
        raise ValueError("grids_per_rank must list at least one rank")
    return tuple(tuple(_grid(g, merge, f"grids_per_rank[{r}][{i}]") for i, g in enumerate(gs))
                 for r, gs in enumerate(grids_per_rank))


def _block_rows(sizes: Sequence[int], order: Sequence[int]) -> np.ndarray:
    """Row indices that list the blocks ``order`` (block ids) of a buffer whose blocks, in
    id order, have ``sizes`` rows."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
    if not len(order):
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(starts[b], starts[b + 1], dtype=np.int64) for b in order])


@dataclass(frozen=True)
class VisionPlan:
    grids: tuple[tuple[Grid, ...], ...]        # per owner rank: its items, local order
    merge_size: int                            # spatial merge: merged rows = t*h*w / merge**2
    encoder: tuple[tuple[int, ...], ...]       # per owner rank: vision rank of each item
    shares: tuple[tuple[tuple[int, int], ...], ...]  # per vision rank: (owner, pos), sorted
    cost_before: tuple[float, ...]             # per rank: vision cost of its own items
    cost_after: tuple[float, ...]              # per rank: vision cost of its share
    lower_bound: float                         # max(sum / ranks, max item cost)
    pixel_row_bytes: int = 1
    embed_row_bytes: int = 1

    # ---- sizes -------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return len(self.grids)

    @property
    def num_items(self) -> int:
        return sum(len(g) for g in self.grids)

    def patches(self, owner: int, pos: int) -> int:
        t, h, w = self.grids[owner][pos]
        return t * h * w

    def merged(self, owner: int, pos: int) -> int:
        return self.patches(owner, pos) // (self.merge_size * self.merge_size)

    # ---- vision side -------------------------------------------------------------------
    def share_grids(self, rank: int) -> list[Grid]:
        return [self.grids[o][p] for o, p in self.shares[rank]]

    def pixel_recv_counts(self, rank: int) -> list[int]:
        """Pixel rows vision rank ``rank`` receives from each owner (share order)."""
        out = [0] * self.world
        for o, p in self.shares[rank]:
            out[o] += self.patches(o, p)
        return out

    def embed_send_counts(self, rank: int) -> list[int]:
        """Embedding rows vision rank ``rank`` returns to each owner (share order)."""
        out = [0] * self.world
        for o, p in self.shares[rank]:
            out[o] += self.merged(o, p)
        return out

    # ---- owner side --------------------------------------------------------------------
    def send_order(self, rank: int) -> list[int]:
        """Local item positions of owner ``rank`` in the order their pixels are sent
        (grouped by vision rank, each group in position order)."""
        enc = self.encoder[rank]
        return sorted(range(len(enc)), key=lambda i: (enc[i], i))

    def pixel_send_counts(self, rank: int) -> list[int]:
        out = [0] * self.world
        for i, d in enumerate(self.encoder[rank]):
            out[d] += self.patches(rank, i)
        return out

    def pixel_send_rows(self, rank: int) -> np.ndarray:
        """Row index into the owner's pixel rows that puts them in send order."""
        sizes = [self.patches(rank, i) for i in range(len(self.grids[rank]))]
        return _block_rows(sizes, self.send_order(rank))

    def embed_recv_counts(self, rank: int) -> list[int]:
        out = [0] * self.world
        for i, d in enumerate(self.encoder[rank]):
            out[d] += self.merged(rank, i)
        return out

    def arrival_order(self, rank: int) -> list[int]:
        """Local position of each item block, in the order owner ``rank`` receives the
        embeddings (grouped by vision rank, position order within) = ``send_order``."""
        return self.send_order(rank)

    def return_rows(self, rank: int) -> np.ndarray:
        """Row index into the received embedding buffer that restores local item order
        (the inverse of the send permutation, expanded to rows)."""
        arrival = self.arrival_order(rank)
        block_of = {pos: b for b, pos in enumerate(arrival)}
        sizes = [self.merged(rank, pos) for pos in arrival]
        return _block_rows(sizes, [block_of[i] for i in range(len(arrival))])

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
        """(owner, position, vision rank) of every item encoded away from its owner."""
        return [(r, i, d) for r, enc in enumerate(self.encoder) for i, d in enumerate(enc)
                if d != r]

    @property
    def pixel_bytes_moved(self) -> int:
        return sum(self.patches(r, i) for r, i, _ in self.moved_items) * self.pixel_row_bytes

    @property
    def embed_bytes_moved(self) -> int:
        """Forward embedding bytes (merged + every deepstack level); backward moves as many
        gradient bytes again."""
        return sum(self.merged(r, i) for r, i, _ in self.moved_items) * self.embed_row_bytes

    def summary(self) -> dict:
        return {
            "items": self.num_items, "moved_items": len(self.moved_items),
            "cost_before": list(self.cost_before), "cost_after": list(self.cost_after),
            "lower_bound": self.lower_bound,
            "max_over_mean_before": self.max_over_mean_before,
            "max_over_mean_after": self.max_over_mean_after,
            "max_over_lb_before": self.max_over_lb_before,
            "max_over_lb_after": self.max_over_lb_after,
            "pixel_bytes_moved": self.pixel_bytes_moved,
            "embed_bytes_moved": self.embed_bytes_moved,
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 1.0


def item_cost(cost_model, grid: Grid) -> float:
    """Vision cost of one item: ``c0 + t * (cost_model(h * w) - c0)``.

    The Qwen3-VL tower attends within each temporal slice (``cu_seqlens`` repeats ``h * w``
    ``t`` times), so a ``t``-slice item costs ``t`` slices of ``h * w`` patches plus one
    per-item overhead ``c0``; for images (``t = 1``) this is ``cost_model(t * h * w)``.
    Callables without a ``c0`` attribute are taken as ``t * cost_model(h * w)``.
    """
    return float(item_costs(cost_model, [grid])[0])


def item_costs(cost_model, grids: Sequence[Grid]) -> np.ndarray:
    if not len(grids):
        return np.zeros(0, dtype=np.float64)
    t = np.asarray([g[0] for g in grids], dtype=np.float64)
    hw = np.asarray([g[1] * g[2] for g in grids], dtype=np.float64)
    frame = np.asarray(cost_model(hw), dtype=np.float64).reshape(-1)
    if frame.shape != hw.shape or not np.all(np.isfinite(frame) & (frame >= 0)):
        raise ValueError("cost_model must map patch counts to finite non-negative costs")
    c0 = float(getattr(cost_model, "c0", 0.0))
    return c0 + t * (frame - c0)


def _item_costs(grids: tuple[tuple[Grid, ...], ...], cost_model) -> list[list[float]]:
    return [item_costs(cost_model, gs).tolist() for gs in grids]


def _build(grids, merge, encoder, costs, pixel_row_bytes, embed_row_bytes) -> VisionPlan:
    world = len(grids)
    shares: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for r, enc in enumerate(encoder):
        for i, d in enumerate(enc):
            shares[d].append((r, i))
    after = [[] for _ in range(world)]
    for d, share in enumerate(shares):
        share.sort()
        after[d] = [costs[o][p] for o, p in share]
    flat = [c for cs in costs for c in cs]
    lb = max(math.fsum(flat) / world, max(flat)) if flat else 0.0
    return VisionPlan(grids, merge, tuple(tuple(e) for e in encoder),
                      tuple(tuple(s) for s in shares),
                      tuple(math.fsum(c) for c in costs), tuple(math.fsum(c) for c in after),
                      lb, int(pixel_row_bytes), int(embed_row_bytes))


def local_plan(grids_per_rank: Sequence[Sequence[object]], merge_size: int,
               cost_model: StageCostModel = QWEN3_VL_VISION, *, pixel_row_bytes: int = 1,
               embed_row_bytes: int = 1) -> VisionPlan:
    """The unbalanced plan: every rank encodes its own items (for comparisons/metrics)."""
    merge = _positive(merge_size, "merge_size")
    grids = _normalise(grids_per_rank, merge)
    enc = [[r] * len(gs) for r, gs in enumerate(grids)]
    return _build(grids, merge, enc, _item_costs(grids, cost_model), pixel_row_bytes,
                  embed_row_bytes)


def plan_vision(grids_per_rank: Sequence[Sequence[object]], merge_size: int,
                cost_model: StageCostModel = QWEN3_VL_VISION, *, ranks_per_node: int = 8,
                mode: str = "lpt", tolerance: float | None = None,
                placement: str | None = None, pixel_row_bytes: int = 1,
                embed_row_bytes: int = 1) -> VisionPlan:
    """Assign every item to a vision rank so that per-rank vision cost is balanced.

    ``mode``: ``"lpt"`` (near the lower bound; groups are then placed on ranks to keep the
    most bytes where they are) or ``"min_move"`` (fewest moves within ``tolerance``).
    Bytes per item for the placement = pixel bytes + 2 x embedding bytes (forward embeddings
    and backward gradients), from ``pixel_row_bytes`` / ``embed_row_bytes`` (1 by default,
    i.e. rows). Pure and deterministic.
    """
    if mode not in VISION_MODES:
        raise ValueError(f"unknown vision balancing mode {mode!r}; valid modes: "
                         f"{', '.join(VISION_MODES)} (the vision tower is padding-free)")
    merge = _positive(merge_size, "merge_size")
    pixel_row_bytes = _positive(pixel_row_bytes, "pixel_row_bytes")
    embed_row_bytes = _positive(embed_row_bytes, "embed_row_bytes")
    grids = _normalise(grids_per_rank, merge)
    costs = _item_costs(grids, cost_model)
    sizes = [[t * h * w * pixel_row_bytes + 2 * (t * h * w // (merge * merge)) * embed_row_bytes
              for t, h, w in gs] for gs in grids]
    bp = balance(costs, ranks_per_node=ranks_per_node, mode=mode, sizes_per_rank=sizes,
                 tolerance=tolerance, placement=placement)
    enc = [[-1] * len(gs) for gs in grids]
    for d, dest in enumerate(bp.destinations):
        for r, i in dest:
            enc[r][i] = d
    return _build(grids, merge, enc, costs, pixel_row_bytes, embed_row_bytes)


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)
