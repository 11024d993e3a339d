"""Target: transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.
Qwen2_5OmniThinkerForConditionalGeneration (written for transformers 5.6.0 and
4.57.1-4.57.6; ``apply()`` refuses other versions). 5.6.0's ``get_audio_features`` and
``get_image_features``/``get_video_features`` return model outputs, 4.57's the embeddings
tensor; the replacements return what the installed forward reads.

Encoder-stage post-balancing (docs/encoder_balancing.md): ``apply(group, stages)`` wraps the
thinker's ``forward`` and its ``get_audio_features`` (stage ``audio``) and
``get_image_features``/``get_video_features`` (stage ``vision``) so that, in training mode,
the clips, images and videos of all ranks are encoded where ``odb_factory.encoder_stage``'s
plans say and their embeddings come back to the rank that holds their text. ``remove()``
restores the upstream methods. Upstream behaviour is untouched when the patch is not applied,
when a balancer's ``enabled`` is False, and (by default) in eval mode, so evaluation and
``generate()`` stay local.

Why ``forward`` too: upstream calls the feature methods only on ranks whose batch has that
modality, but balancing is a collective, so each stage must run exactly once per forward on
*every* rank. The ``forward`` wrapper encodes the rank's clips (then its images and videos
together) and returns both stages' embeddings in one differentiable exchange (their rows have
the LLM's width); it hands the results to upstream's feature calls (looked up by the identity
of the tensor upstream passes them) and, on a rank without any of the modality, adds
``0 * sum(received rows)`` (an empty sum, exactly 0) to the logits and the loss so that the
rank's backward still runs the reverse exchange the other ranks wait for. Direct calls of the
feature methods outside ``forward`` are balanced too, stage by stage (collective: every rank
must make the same calls).
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

import torch

from ..comm import group_rank_world
from ..versions import ENCODER_STAGE_TRANSFORMERS_RANGES, describe, encoder_stage_supported
from .audio import AudioBalancer
from .routing import return_outputs_together
from .vision import TowerDims, VisionBalancer

STAGES = ("audio", "vision")
_UPSTREAM = ("forward", "get_audio_features", "get_image_features", "get_video_features")

_state: dict[str, Any] = {}
_local = threading.local()


def _stash() -> dict:
    if not hasattr(_local, "items"):
        _local.items = {}
    return _local.items


def balancer(stage: str = "audio") -> AudioBalancer | VisionBalancer | None:
    """The active balancer of ``stage`` (None when not applied)."""
    return _state.get("balancers", {}).get(stage)


def _active(model, stage: str):
    bal = balancer(stage)
    if bal is None or not bal.enabled:
        return None
    if _state["training_only"] and not model.training:
        return None
    return bal


def _audio_output(embeds: torch.Tensor):
    import transformers
    if transformers.__version__.startswith("4."):  # 4.57 returns the tensor
        return embeds
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    return BaseModelOutputWithPooling(last_hidden_state=embeds)


def _vision_output(embeds: torch.Tensor):
    import transformers
    if transformers.__version__.startswith("4."):
        return embeds
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    return BaseModelOutputWithPooling(last_hidden_state=None, pooler_output=embeds)


def _from_stash(tensor):
    hit = _stash().pop(id(tensor), None)
    return hit[1] if hit is not None and hit[0] is tensor else None


def _get_audio_features(self, input_features, feature_attention_mask=None,
                        audio_feature_lengths=None, **kwargs):
    hit = _from_stash(input_features)
    if hit is not None:
        return hit
    bal = _active(self, "audio")
    if bal is None:
        return _state["get_audio_features"](self, input_features, feature_attention_mask,
                                            audio_feature_lengths, **kwargs)
    return _audio_output(bal.encode(input_features, feature_attention_mask, self.audio_tower))


def _vision_features(name: str):
    def method(self, pixel_values, grid_thw=None, **kwargs):
        hit = _from_stash(pixel_values)
        if hit is not None:
            return hit
        bal = _active(self, "vision")
        if bal is None:
            return _state[name](self, pixel_values, grid_thw, **kwargs)
        embeds, _ = bal.encode(pixel_values, grid_thw, self.visual)
        return _vision_output(embeds)
    method.__name__ = name
    return method


def _encode_shares(self, kwargs):
    """Both stages' share outputs (None for a stage that is off or has no item anywhere),
    with what the forward needs to hand the results back."""
    shares = {}
    audio = _active(self, "audio")
    if audio is not None:
        out = audio.encode_share(kwargs.get("input_features"), kwargs.get("feature_attention_mask"),
                                 self.audio_tower)
        if out is not None:
            shares["audio"] = (out, audio)
    vision = _active(self, "vision")
    if vision is not None:
        pv, pvv = kwargs.get("pixel_values"), kwargs.get("pixel_values_videos")
        img = kwargs.get("image_grid_thw") if pv is not None else None
        vid = kwargs.get("video_grid_thw") if pvv is not None else None
        parts = [p for p, g in ((pv, img), (pvv, vid)) if g is not None]
        grids = [g for g in (img, vid) if g is not None]
        dims = TowerDims.of(self.visual)
        out = vision.encode_share(torch.cat([p.to(dims.dtype) for p in parts]) if parts else None,
                                  torch.cat(grids) if grids else None, self.visual, dims=dims)
        if out is not None:
            shares["vision"] = (out, vision)
    return shares


def _return_shares(shares: dict, group) -> dict:
    """Every stage's embeddings of this rank's items, local order: one exchange when both
    stages have rows of the same width, else one per stage."""
    stages = list(shares)
    rank = group_rank_world(group)[0]
    parts = [(shares[s][0], shares[s][1].last_stats.plan) for s in stages]
    widths = {out.shape[1] for out, _ in parts}
    groups = [stages] if len(widths) == 1 else [[s] for s in stages]
    out = {}
    for names in groups:
        bal = shares[names[0]][1]
        start = time.perf_counter()
        backs, sent = return_outputs_together([parts[stages.index(s)] for s in names], rank, group,
                                              what=f"{' + '.join(names)} embeddings", step=bal.step,
                                              timeout_s=bal.timeout_s)
        seconds = time.perf_counter() - start  # one exchange: each stage records it
        for s, back, nbytes in zip(names, backs, sent):
            out[s] = back
            shares[s][1].last_stats.embed_bytes_sent = nbytes
            shares[s][1].last_stats.embed_exchange_s = seconds
    return out


def _forward(self, *args, **kwargs):
    if _active(self, "audio") is None and _active(self, "vision") is None:
        return _state["forward"](self, *args, **kwargs)
    for name, value in zip(_state["forward_params"], args):
        kwargs[name] = value
    shares = _encode_shares(self, kwargs)
    embeds = _return_shares(shares, _state["group"]) if shares else {}
    stash, unused = _stash(), []
    if "audio" in embeds:
        features = kwargs.get("input_features")
        if features is not None:
            stash[id(features)] = (features, _audio_output(embeds["audio"]))
        else:
            unused.append(embeds["audio"])
    if "vision" in embeds:
        vision = embeds["vision"]
        if vision.shape[1] != TowerDims.of(self.visual).out_hidden:
            raise ValueError("Qwen2.5-Omni's vision tower returned deepstack features; this patch "
                             "expects merged embeddings only")
        merge = self.visual.spatial_merge_size
        n_img = 0
        for key, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            pixels, grid = kwargs.get(key), kwargs.get(grid_key)
            if pixels is None or grid is None:
                continue
            rows = int((grid.prod(-1) // (merge * merge)).sum())
            stash[id(pixels)] = (pixels, _vision_output(vision[n_img:n_img + rows]))
            n_img += rows
        if n_img == 0:
            unused.append(vision)
    try:
        out = _state["forward"](self, **kwargs)
    finally:
        stash.clear()
    anchors = [e.sum() * 0 for e in unused if e.requires_grad]
    if anchors:  # nothing of ours consumed these rows: tie them to the loss (adds exactly 0)
        anchor = sum(anchors)
        out.logits = out.logits + anchor
        if getattr(out, "loss", None) is not None:
            out.loss = out.loss + anchor
    return out


def apply(group: Any | None = None, stages: tuple[str, ...] = ("audio",), *,
          training_only: bool = True, **balancer_kwargs: Any) -> AudioBalancer | VisionBalancer:
    """Patch the Qwen2.5-Omni thinker to balance ``stages`` (``audio`` and/or ``vision``)
    over ``group`` (None = the default group). ``balancer_kwargs`` go to both balancers
    (``ranks_per_node``, ``mode``, ``tolerance``, ``placement``, ``timeout_s``, ``enabled``).
    Returns the balancer of the first stage (``balancer(stage)`` gives each). Applying again
    replaces the balancers."""
    import transformers
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as mod
    if not encoder_stage_supported(transformers.__version__):
        raise RuntimeError(f"odb-factory's Qwen2.5-Omni encoder balancing was written for "
                           f"transformers {describe(ENCODER_STAGE_TRANSFORMERS_RANGES)}; transformers "
                           f"{transformers.__version__} is installed")
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise ValueError(f"stages must list some of {list(STAGES)}, got {list(stages)}")
    cls = mod.Qwen2_5OmniThinkerForConditionalGeneration
    if "forward" not in _state:
        for name in _UPSTREAM:
            _state[name] = getattr(cls, name)
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        _state["forward_params"] = [p.name for p in params if p.kind in (
            p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        cls.forward = _forward
        cls.get_audio_features = _get_audio_features
        cls.get_image_features = _vision_features("get_image_features")
        cls.get_video_features = _vision_features("get_video_features")
    makers = {"audio": AudioBalancer, "vision": VisionBalancer}
    _state["balancers"] = {s: makers[s](group, **balancer_kwargs) for s in stages}
    _state["group"] = group
    _state["training_only"] = training_only
    return _state["balancers"][stages[0]]


def remove() -> None:
    """Restore the thinker's upstream methods."""
    if "forward" not in _state:
        return
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as mod
    for name in _UPSTREAM:
        setattr(mod.Qwen2_5OmniThinkerForConditionalGeneration, name, _state[name])
    _state.clear()
    _stash().clear()
