"""Target: transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLModel (written for
transformers 5.6.0 and 4.57.1-4.57.6; ``apply()`` refuses other versions). 5.6.0's
``get_image_features`` returns a ``BaseModelOutputWithDeepstackFeatures``, 4.57's the tuple
(embeddings split per item, deepstack features); the replacement returns what the installed
forward reads.

Vision-stage post-balancing (docs/encoder_balancing.md): ``apply(group)`` wraps
``Qwen3VLModel.get_image_features`` and ``Qwen3VLModel.forward`` so that, in training mode,
the images (and videos) of all ranks are encoded where ``odb_factory.encoder_stage``'s plan
says and their embeddings come back to the rank that holds their text. ``remove()``
restores the upstream methods. Upstream behaviour is untouched when the patch is not
applied, when ``balancer().enabled`` is False, and (by default) in eval mode -- so
evaluation and ``generate()``, whose ranks need not call the model in lockstep, stay local.

Why ``forward`` too: upstream calls ``get_image_features`` only on ranks whose batch has
pixels (and a second time for videos), but balancing is a collective, so it must run
exactly once per forward on *every* rank. The ``forward`` wrapper therefore encodes the
rank's images and videos together with one ``VisionBalancer.encode`` call, hands the
results to upstream's ``get_image_features``/``get_video_features`` calls (looked up by the
identity of the pixel tensor it passes them), and, on a rank without any image or video,
adds ``0 * sum(received rows)`` (an empty sum, exactly 0) to ``last_hidden_state`` so that
the rank's backward still runs the reverse exchange that other ranks wait for.

Composed exchange: a batch may carry ``odb_vision_plan`` (a ``VisionPlan`` made with the
same ``plan_vision`` call on every rank, e.g. by the data loader). Then ``pixel_values``
holds this rank's vision *share* (images and videos alike, in plan share order),
``pixel_values_videos`` must be None, and ``image_grid_thw``/``video_grid_thw`` describe the
rank's own items (images first, then videos, as in the plan); only the embedding exchange
runs. Direct calls of ``get_image_features``/``get_video_features`` outside ``forward``
are balanced too (collective: every rank must make the same calls); their
``last_hidden_state`` is None under balancing (the pre-merge states of a local image live
on its vision rank), as are captured vision hidden states/attentions.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch

from ..balance import QWEN3_VL_VISION, StageCostModel
from ..versions import ENCODER_STAGE_TRANSFORMERS_RANGES, describe, encoder_stage_supported
from .vision import TowerDims, VisionBalancer

PLAN_KWARG = "odb_vision_plan"

_state: dict[str, Any] = {}
_local = threading.local()


def _stash() -> dict:
    if not hasattr(_local, "items"):
        _local.items = {}
    return _local.items


def balancer() -> VisionBalancer | None:
    """The active balancer (None when not applied)."""
    return _state.get("balancer")


def _active(model) -> VisionBalancer | None:
    bal = _state.get("balancer")
    if bal is None or not bal.enabled:
        return None
    if _state["training_only"] and not model.training:
        return None
    return bal


def _output(model, embeds: torch.Tensor, deepstack: list, grids: torch.Tensor | None):
    from transformers.models.qwen3_vl import modeling_qwen3_vl as mod
    if grids is None or grids.shape[0] == 0:
        sizes: list[int] = []
    else:
        sizes = (grids.prod(-1) // model.visual.spatial_merge_size ** 2).tolist()
    per_item = tuple(torch.split(embeds, sizes)) if sizes else ()
    output_class = getattr(mod, "BaseModelOutputWithDeepstackFeatures", None)
    if output_class is None:  # transformers 4.57
        return per_item, deepstack
    return output_class(last_hidden_state=None, pooler_output=per_item, deepstack_features=deepstack)


def _maybe_tuple(model, out, kwargs):
    if isinstance(out, tuple):  # transformers 4.57 returns a plain tuple
        return out
    return_dict = kwargs.get("return_dict")
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    return out if return_dict else out.to_tuple()


def _get_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
    hit = _stash().pop(id(pixel_values), None)
    if hit is not None and hit[0] is pixel_values:
        return _maybe_tuple(self, hit[1], kwargs)
    bal = _active(self)
    if bal is None:
        return _state["get_image_features"](self, pixel_values, image_grid_thw, **kwargs)
    embeds, deepstack = bal.encode(pixel_values, image_grid_thw, self.visual)
    return _maybe_tuple(self, _output(self, embeds, deepstack, image_grid_thw), kwargs)


def _rows(grids: torch.Tensor | None, merge: int) -> int:
    return 0 if grids is None else int((grids.prod(-1) // (merge * merge)).sum())


def _forward(self, *args, **kwargs):
    plan = kwargs.pop(PLAN_KWARG, None)
    bal = _active(self)
    if bal is None:
        if plan is not None:
            raise ValueError(f"the batch carries {PLAN_KWARG} but vision balancing is not "
                             f"active (apply() it, enable it and use training mode)")
        return _state["forward"](self, *args, **kwargs)
    for name, value in zip(_state["forward_params"], args):
        kwargs[name] = value
    pv, pvv = kwargs.get("pixel_values"), kwargs.get("pixel_values_videos")
    igt, vgt = kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw")
    composed = plan is not None
    if composed:
        if pvv is not None:
            raise ValueError(f"with {PLAN_KWARG}, pixel_values holds the whole vision share; "
                             f"pixel_values_videos must be None")
        img = igt if igt is not None and igt.shape[0] else None
        vid = vgt if vgt is not None and vgt.shape[0] else None
        pixels = pv
    else:
        img = igt if pv is not None else None
        vid = vgt if pvv is not None else None
        parts = [p for p, g in ((pv, img), (pvv, vid)) if g is not None]
        dtype = self.visual.dtype
        pixels = torch.cat([p.to(dtype) for p in parts]) if parts else None
    grids = [g for g in (img, vid) if g is not None]
    grid = torch.cat(grids) if grids else None
    dims = TowerDims.of(self.visual)
    embeds, deepstack = bal.encode(pixels, grid, self.visual, plan=plan, dims=dims)

    stash = _stash()
    n_img = _rows(img, dims.merge_size)
    if img is not None:
        key = pv if (pv is not None and not composed) else torch.empty(0)
        stash[id(key)] = (key, _output(self, embeds[:n_img], [d[:n_img] for d in deepstack], img))
        kwargs["pixel_values"] = key
    else:
        kwargs["pixel_values"] = None
    if vid is not None:
        key = pvv if not composed else torch.empty(0)
        stash[id(key)] = (key, _output(self, embeds[n_img:], [d[n_img:] for d in deepstack], vid))
        kwargs["pixel_values_videos"] = key
    else:
        kwargs["pixel_values_videos"] = None
    try:
        out = _state["forward"](self, **kwargs)
    finally:
        stash.clear()
    if img is None and vid is None and embeds.requires_grad:
        # nothing of ours consumed the exchange's output: tie it to the loss (adds exactly 0)
        anchor = embeds.sum() * 0
        if isinstance(out, tuple):
            out = (out[0] + anchor,) + tuple(out[1:])
        else:
            out.last_hidden_state = out.last_hidden_state + anchor
    return out


def apply(group: Any | None = None, cost_model: StageCostModel = QWEN3_VL_VISION, *,
          training_only: bool = True, **balancer_kwargs: Any) -> VisionBalancer:
    """Patch Qwen3VLModel to balance its vision stage over ``group`` (None = default group;
    gloo or NCCL). ``balancer_kwargs`` go to ``VisionBalancer`` (``ranks_per_node``,
    ``mode``, ``tolerance``, ``placement``, ``timeout_s``, ``enabled``). Returns the
    balancer (``.enabled``, ``.last_stats``, ``.history``). Applying again replaces the
    balancer."""
    import transformers
    from transformers.models.qwen3_vl import modeling_qwen3_vl as mod
    if not encoder_stage_supported(transformers.__version__):
        raise RuntimeError(f"odb-factory's Qwen3-VL vision balancing was written for "
                           f"transformers {describe(ENCODER_STAGE_TRANSFORMERS_RANGES)}; transformers "
                           f"{transformers.__version__} is installed")
    cls = mod.Qwen3VLModel
    if "forward" not in _state:
        _state["forward"] = cls.forward
        _state["get_image_features"] = cls.get_image_features
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        _state["forward_params"] = [p.name for p in params if p.kind in (
            p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        cls.forward = _forward
        cls.get_image_features = _get_image_features
    _state["balancer"] = VisionBalancer(group, cost_model, **balancer_kwargs)
    _state["training_only"] = training_only
    return _state["balancer"]


def remove() -> None:
    """Restore upstream ``Qwen3VLModel.forward`` and ``get_image_features``."""
    if "forward" not in _state:
        return
    from transformers.models.qwen3_vl import modeling_qwen3_vl as mod
    mod.Qwen3VLModel.forward = _state["forward"]
    mod.Qwen3VLModel.get_image_features = _state["get_image_features"]
    _state.clear()
    _stash().clear()
