"""Pure planning of the vision stage: which rank encodes which image, and the bookkeeping
to bring each embedding block back to the rank that holds its text.

Inputs are every rank's per-item grids ``(t, h, w)`` in local order (an *item* is an image
or a video: the vision tower treats both alike). The cost of an item is ``item_cost``:
``cost_model(h * w)`` per temporal slice (``= cost_model(t * h * w)`` for images, whose
``t`` is 1); ``odb_factory.balance.balance`` (LPT by default)
decides the vision rank of every item. Everything here is a deterministic function of
its arguments, so every rank computes the same plan from the same all-gathered grids.

The row bookkeeping (orders, counts, permutations, metrics) is ``EncoderPlan``'s
(``odb_factory.balance.encoder_plan``); here an item's input rows are its pixel patches
``t * h * w`` and its output rows the merged tokens ``t * h * w / merge**2``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from odb_factory.balance import QWEN3_VL_VISION, StageCostModel
from odb_factory.balance.encoder_plan import EncoderPlan, assign_items, shares_and_costs

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


@dataclass(frozen=True)
class VisionPlan(EncoderPlan):
    grids: tuple[tuple[Grid, ...], ...]        # per owner rank: its items, local order
    merge_size: int                            # spatial merge: merged rows = t*h*w / merge**2
    encoder: tuple[tuple[int, ...], ...]       # per owner rank: vision rank of each item
    shares: tuple[tuple[tuple[int, int], ...], ...]  # per vision rank: (owner, pos), sorted
    cost_before: tuple[float, ...]             # per rank: vision cost of its own items
    cost_after: tuple[float, ...]              # per rank: vision cost of its share
    lower_bound: float                         # max(sum / ranks, max item cost)
    pixel_row_bytes: int = 1
    embed_row_bytes: int = 1

    def patches(self, owner: int, pos: int) -> int:
        t, h, w = self.grids[owner][pos]
        return t * h * w

    def merged(self, owner: int, pos: int) -> int:
        return self.patches(owner, pos) // (self.merge_size * self.merge_size)

    in_rows = patches
    out_rows = merged

    @property
    def in_row_bytes(self) -> int:
        return self.pixel_row_bytes

    @property
    def out_row_bytes(self) -> int:
        return self.embed_row_bytes

    def share_grids(self, rank: int) -> list[Grid]:
        return [self.grids[o][p] for o, p in self.shares[rank]]

    # the vision names of the shared bookkeeping (pixels in, embeddings out)
    pixel_recv_counts = EncoderPlan.input_recv_counts
    embed_send_counts = EncoderPlan.output_send_counts
    pixel_send_counts = EncoderPlan.input_send_counts
    pixel_send_rows = EncoderPlan.input_send_rows
    embed_recv_counts = EncoderPlan.output_recv_counts
    arrival_order = EncoderPlan.send_order
    pixel_bytes_moved = EncoderPlan.input_bytes_moved
    embed_bytes_moved = EncoderPlan.output_bytes_moved

    def summary(self) -> dict:
        return {**self.balance_summary(), "pixel_bytes_moved": self.pixel_bytes_moved,
                "embed_bytes_moved": self.embed_bytes_moved}


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
        return np.zeros(0)
    t = np.asarray([g[0] for g in grids], dtype=np.float64)  # pragma: no mutate, frame is float64: t's dtype cannot change the product
    # float64 counts: a cost model's powers of h*w cannot overflow an integer type
    hw = np.asarray([g[1] * g[2] for g in grids], dtype=np.float64)
    frame = np.asarray(cost_model(hw), dtype=np.float64).ravel()
    if frame.shape != hw.shape or not np.all(np.isfinite(frame) & (frame >= 0)):
        raise ValueError("cost_model must map patch counts to finite non-negative costs")
    c0 = float(getattr(cost_model, "c0", 0.0))
    return c0 + t * (frame - c0)


def _item_costs(grids: tuple[tuple[Grid, ...], ...], cost_model) -> list[list[float]]:
    return [item_costs(cost_model, gs).tolist() for gs in grids]


def _build(grids, merge, encoder, costs, pixel_row_bytes, embed_row_bytes) -> VisionPlan:
    return VisionPlan(grids, merge, **shares_and_costs(encoder, costs),
                      pixel_row_bytes=int(pixel_row_bytes), embed_row_bytes=int(embed_row_bytes))


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
    enc = assign_items(costs, sizes, ranks_per_node=ranks_per_node, mode=mode,
                       tolerance=tolerance, placement=placement)
    return _build(grids, merge, enc, costs, pixel_row_bytes, embed_row_bytes)


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)
