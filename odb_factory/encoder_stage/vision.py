"""Vision-stage post-balancing: images are encoded where the plan says, and their
embeddings (merged + every deepstack level) come back to the rank that holds their text.

``VisionBalancer(group, cost_model).encode(pixel_values, grid_thw, vision_tower)`` is a
collective. On every rank it

1. all-gathers the per-item grids (small ints) over ``group``;
2. plans (``plan_vision``: pure, identical on every rank);
3. moves pixel rows to their vision rank (no autograd: pixels get no gradient);
4. runs ``vision_tower(pixels_share, grid_thw=grid_share)`` -- always exactly once per call,
   on a one-merged-token dummy input when its share is empty (see below);
5. packs the merged embeddings and the deepstack features side by side (same rows) and
   sends each owner its rows with the differentiable ``all_to_all_rows``;
6. restores the owner's item order with a row permutation (``index_select``).

and returns ``(embeds, deepstack)`` equal to what ``vision_tower(pixel_values, grid_thw)``
returns for the local items (``pooler_output`` and ``deepstack_features`` of transformers'
``Qwen3VLVisionModel``). Backward: the gradient rows travel back to the encoding rank, so
vision-tower parameter gradients summed over ranks equal those of local encoding.

Empty share: when there are fewer items than ranks (or a plan leaves a rank empty) the
rank still calls the tower, on ``merge**2`` zero pixel rows with grid ``(1, merge, merge)``
(one merged token), and sends a 0-row slice of that output. ZeRO-3 parameter gathers,
hooks and DDP's "parameter was used" bookkeeping therefore see the same calls on every
rank, and the dummy's contribution to every gradient is exactly zero (the slice's
backward scatters a zero gradient; no multiplication by 0, so no NaN*0 either). When no
rank has any item the step is skipped on every rank alike (the tower is not called,
exactly as upstream would not call it).

Composed exchange: if the data loader already shipped each item's pixels to its vision
rank (using the same ``plan_vision`` result), pass ``plan=`` and the local share's pixel
rows (share order) as ``pixel_values``: steps 1-3 disappear and only the embedding
exchange (5) remains.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from odb_factory.balance import QWEN3_VL_VISION

from odb_factory.balance.vision_plan import VisionPlan, plan_vision
from odb_factory.comm import ODBExchangeError, gather_objects
from odb_factory.comm.row_exchange import HINT

from .balancer import StageBalancer
from .routing import return_outputs, send_inputs


@dataclass
class TowerDims:
    merge_size: int
    pixel_width: int      # in_channels * temporal_patch_size * patch_size**2
    out_hidden: int       # width of merged embeddings and of each deepstack feature
    num_deepstack: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tower: Any) -> TowerDims:
        """Read from a transformers Qwen3-VL (or Qwen2.5-VL-like) vision tower."""
        cfg = tower.config
        try:
            param = next(tower.parameters())
        except StopIteration:
            raise ValueError("vision_tower has no parameters; cannot infer dtype/device") from None
        merge = int(getattr(tower, "spatial_merge_size", cfg.spatial_merge_size))
        width = int(cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2)
        return cls(merge, width, int(cfg.out_hidden_size),
                   len(getattr(cfg, "deepstack_visual_indexes", None) or ()),
                   param.dtype, param.device)


@dataclass
class VisionStepStats:
    """What one ``encode`` call did on this rank (``plan`` is the same on every rank)."""

    plan: VisionPlan | None
    local_items: int = 0
    share_items: int = 0
    dummy: bool = False           # the tower ran on the dummy input
    composed: bool = False        # plan given: no pixel exchange
    plan_s: float = 0.0           # all-gather of the grids + planning
    pixel_exchange_s: float = 0.0
    tower_s: float = 0.0
    embed_exchange_s: float = 0.0
    pixel_bytes_sent: int = 0     # by this rank
    embed_bytes_sent: int = 0     # by this rank, forward (backward returns as many)
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        out = dict(self.plan.summary()) if self.plan is not None else {}
        out.update(local_items=self.local_items, share_items=self.share_items,
                   dummy=self.dummy, composed=self.composed, plan_s=self.plan_s,
                   pixel_exchange_s=self.pixel_exchange_s, tower_s=self.tower_s,
                   embed_exchange_s=self.embed_exchange_s,
                   pixel_bytes_sent=self.pixel_bytes_sent,
                   embed_bytes_sent=self.embed_bytes_sent)
        return out


def _grid_list(grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    if grid_thw is None:
        return []
    return [tuple(int(v) for v in row) for row in grid_thw.tolist()]


def _tower_outputs(out: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if isinstance(out, torch.Tensor):  # a tower without deepstack, as transformers 4.57 returns it
        return out, []
    if hasattr(out, "pooler_output"):
        return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])
    embeds, deepstack = out[0], out[1] if len(out) > 1 else []
    return embeds, list(deepstack or [])


class VisionBalancer(StageBalancer):
    """Balance the vision tower's work across the ranks of ``group`` (see module doc and
    ``StageBalancer`` for the options)."""

    default_cost_model = QWEN3_VL_VISION

    # ---- planning (collective) ----------------------------------------------------------
    def plan(self, local_grids: Sequence[Sequence[int]], dims: TowerDims) -> VisionPlan:
        """All-gather every rank's grids and plan (same result on every rank)."""
        every = gather_objects([tuple(int(v) for v in g) for g in local_grids], self.group,
                               "vision grids", f"step {self.step}", self.timeout_s,
                               hint=HINT, error=ODBExchangeError)
        itemsize = torch.empty((), dtype=dims.dtype).element_size()
        return plan_vision(every, dims.merge_size, self.cost_model,
                           ranks_per_node=self.ranks_per_node, mode=self.mode,
                           tolerance=self.tolerance, placement=self.placement,
                           pixel_row_bytes=dims.pixel_width * itemsize,
                           embed_row_bytes=dims.out_hidden * (1 + dims.num_deepstack) * itemsize)

    # ---- the mechanism ------------------------------------------------------------------
    def encode(self, pixel_values: torch.Tensor | None, grid_thw: torch.Tensor | None,
               vision_tower: Any, *, plan: VisionPlan | None = None,
               dims: TowerDims | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embeddings of this rank's items, as ``vision_tower(pixel_values, grid_thw)``
        would return them: ``(embeds, [deepstack_0, ...])``, rows in local item order.

        Collective over ``group``: every rank calls it, also with ``pixel_values=None``.
        With ``plan`` (composed exchange) ``pixel_values`` holds this rank's *share* (the
        rows of ``plan.share_grids(rank)``, in that order) and ``grid_thw`` (optional) is
        checked against the rank's own items ``plan.grids[rank]``.
        """
        dims = dims or TowerDims.of(vision_tower)
        if not self.enabled:
            return self._local(pixel_values, grid_thw, vision_tower, dims)
        share_out = self.encode_share(pixel_values, grid_thw, vision_tower, plan=plan, dims=dims)
        if share_out is None:
            return self._empty(dims)
        stats, rank = self.last_stats, self.rank_world[0]
        t0 = time.perf_counter()
        out, stats.embed_bytes_sent = return_outputs(
            share_out, stats.plan, rank, self.group, what="vision embeddings", step=self.step,
            timeout_s=self.timeout_s)
        stats.embed_exchange_s = time.perf_counter() - t0
        return self.unpack(out, dims)

    def encode_share(self, pixel_values: torch.Tensor | None, grid_thw: torch.Tensor | None,
                     vision_tower: Any, *, plan: VisionPlan | None = None,
                     dims: TowerDims | None = None) -> torch.Tensor | None:
        """Steps 1-4 of ``encode``: the tower's output rows of this rank's share (merged
        embeddings and deepstack levels side by side, share order), still to be returned to
        their owners (``self.last_stats.plan`` says how); None when no rank has an item.
        Collective, like ``encode``."""
        dims = dims or TowerDims.of(vision_tower)
        rank, world = self.rank_world
        self.step += 1
        stats = VisionStepStats(plan=None, composed=plan is not None)
        t0 = time.perf_counter()
        local_grids = _grid_list(grid_thw)
        if plan is None:
            plan = self.plan(local_grids, dims)
        else:
            self._check_plan(plan, local_grids, grid_thw is not None, rank, world)
        stats.plan = plan
        stats.plan_s = time.perf_counter() - t0
        stats.local_items = len(plan.grids[rank])
        stats.share_items = len(plan.shares[rank])
        self._record(stats)
        if plan.num_items == 0:  # nobody has anything: skip on every rank alike
            return None

        # (3) pixels to their vision rank
        width = dims.pixel_width
        if pixel_values is None:
            pixel_values = torch.empty((0, width), dtype=dims.dtype, device=dims.device)
        pixels = pixel_values.detach().to(device=dims.device, dtype=dims.dtype)
        if pixels.dim() != 2 or pixels.shape[1] != width:
            raise ValueError(f"rank {rank}: pixel_values must have shape (rows, {width}), got "
                             f"{tuple(pixels.shape)}")
        t0 = time.perf_counter()
        if stats.composed:
            share = pixels
        else:
            share, stats.pixel_bytes_sent = send_inputs(
                pixels, plan, rank, self.group, what="vision pixels", step=self.step,
                timeout_s=self.timeout_s)
        expected = sum(t * h * w for t, h, w in plan.share_grids(rank))
        if share.shape[0] != expected:
            raise ValueError(f"rank {rank}: the vision share has {share.shape[0]} pixel rows "
                             f"but the plan's share grids describe {expected}")
        stats.pixel_exchange_s = time.perf_counter() - t0

        # (4) the tower, always exactly once
        t0 = time.perf_counter()
        share_grids = plan.share_grids(rank)
        if not share_grids:
            stats.dummy = True
            m = dims.merge_size
            share = torch.zeros((m * m, width), dtype=dims.dtype, device=dims.device)
            share_grids = [(1, m, m)]
        grid = torch.tensor(share_grids, dtype=torch.long, device=dims.device)
        embeds, deepstack = _tower_outputs(vision_tower(share, grid_thw=grid, return_dict=True))
        if len(deepstack) != dims.num_deepstack:
            raise ValueError(f"vision tower returned {len(deepstack)} deepstack features, "
                             f"expected {dims.num_deepstack}")
        packed = torch.cat([embeds] + deepstack, dim=1) if deepstack else embeds
        if stats.dummy:
            packed = packed[:0]
        stats.tower_s = time.perf_counter() - t0

        return packed

    # ---- helpers ------------------------------------------------------------------------
    @staticmethod
    def unpack(out: torch.Tensor, dims: TowerDims) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = dims.out_hidden
        if out.shape[1] != h * (1 + dims.num_deepstack):
            raise ValueError(f"embedding rows have width {out.shape[1]}, expected "
                             f"{h} x (1 + {dims.num_deepstack} deepstack levels)")
        parts = [out[:, k * h:(k + 1) * h].contiguous() for k in range(1 + dims.num_deepstack)]
        return parts[0], parts[1:]

    @staticmethod
    def _empty(dims: TowerDims) -> tuple[torch.Tensor, list[torch.Tensor]]:
        e = torch.empty((0, dims.out_hidden), dtype=dims.dtype, device=dims.device)
        return e, [e.clone() for _ in range(dims.num_deepstack)]

    def _local(self, pixel_values, grid_thw, tower, dims):
        if pixel_values is None or grid_thw is None or grid_thw.shape[0] == 0:
            return self._empty(dims)
        out = tower(pixel_values.to(dims.dtype), grid_thw=grid_thw, return_dict=True)
        return _tower_outputs(out)

    @staticmethod
    def _check_plan(plan: VisionPlan, local_grids, have_grids: bool, rank: int,
                    world: int) -> None:
        if plan.world != world:
            raise ValueError(f"rank {rank}: the vision plan is for {plan.world} ranks, the "
                             f"group has {world}")
        if have_grids and list(plan.grids[rank]) != local_grids:
            raise ValueError(f"rank {rank}: grid_thw {local_grids} does not match the plan's "
                             f"items for this rank {list(plan.grids[rank])}")
