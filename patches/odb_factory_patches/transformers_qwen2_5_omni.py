"""Target: transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.
Qwen2_5OmniThinkerForConditionalGeneration (written for transformers 5.6.0 and
4.57.1-4.57.6; ``apply()`` refuses other versions). 5.6.0's ``get_audio_features`` returns the
tower's ``BaseModelOutputWithPooling``, 4.57's the embeddings tensor; the replacement returns
what the installed forward reads.

Audio-stage post-balancing (docs/encoder_balancing.md): ``apply(group)`` wraps the thinker's
``get_audio_features`` and ``forward`` so that, in training mode, the audio clips of all ranks
are encoded where ``odb_factory.encoder_stage.audio``'s plan says and their embeddings come
back to the rank that holds their text. ``remove()`` restores the upstream methods. Upstream
behaviour is untouched when the patch is not applied, when ``balancer().enabled`` is False, and
(by default) in eval mode, so evaluation and ``generate()`` stay local.

Why ``forward`` too: upstream calls ``get_audio_features`` only on ranks whose batch has audio,
but balancing is a collective, so it must run exactly once per forward on *every* rank. The
``forward`` wrapper encodes the rank's clips with one ``AudioBalancer.encode`` call, hands the
result to upstream's ``get_audio_features`` call (looked up by the identity of the feature
tensor upstream passes it) and, on a rank without audio, adds ``0 * sum(received rows)`` (an
empty sum, exactly 0) to the logits and the loss so that the rank's backward still runs the
reverse exchange the other ranks wait for. Direct calls of ``get_audio_features`` outside
``forward`` are balanced too (collective: every rank must make the same calls).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch

from odb_factory.encoder_stage.audio import AudioBalancer

TRANSFORMERS_VERSIONS = ("4.57.1", "4.57.2", "4.57.3", "4.57.4", "4.57.5", "4.57.6", "5.6.0")

_state: dict[str, Any] = {}
_local = threading.local()


def _stash() -> dict:
    if not hasattr(_local, "items"):
        _local.items = {}
    return _local.items


def balancer() -> AudioBalancer | None:
    """The active balancer (None when not applied)."""
    return _state.get("balancer")


def _active(model) -> AudioBalancer | None:
    bal = _state.get("balancer")
    if bal is None or not bal.enabled:
        return None
    if _state["training_only"] and not model.training:
        return None
    return bal


def _output(embeds: torch.Tensor):
    import transformers
    if transformers.__version__.startswith("4."):  # 4.57 returns the tensor
        return embeds
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    return BaseModelOutputWithPooling(last_hidden_state=embeds)


def _get_audio_features(self, input_features, feature_attention_mask=None,
                        audio_feature_lengths=None, **kwargs):
    hit = _stash().pop(id(input_features), None)
    if hit is not None and hit[0] is input_features:
        return hit[1]
    bal = _active(self)
    if bal is None:
        return _state["get_audio_features"](self, input_features, feature_attention_mask,
                                            audio_feature_lengths, **kwargs)
    return _output(bal.encode(input_features, feature_attention_mask, self.audio_tower))


def _forward(self, *args, **kwargs):
    bal = _active(self)
    if bal is None:
        return _state["forward"](self, *args, **kwargs)
    for name, value in zip(_state["forward_params"], args):
        kwargs[name] = value
    features = kwargs.get("input_features")
    embeds = bal.encode(features, kwargs.get("feature_attention_mask"), self.audio_tower)
    stash = _stash()
    if features is not None:
        stash[id(features)] = (features, _output(embeds))
    try:
        out = _state["forward"](self, **kwargs)
    finally:
        stash.clear()
    if features is None and embeds.requires_grad:
        # nothing of ours consumed the exchange's output: tie it to the loss (adds exactly 0)
        anchor = embeds.sum() * 0
        out.logits = out.logits + anchor
        if getattr(out, "loss", None) is not None:
            out.loss = out.loss + anchor
    return out


def apply(group: Any | None = None, *, training_only: bool = True,
          **balancer_kwargs: Any) -> AudioBalancer:
    """Patch the Qwen2.5-Omni thinker to balance its audio stage over ``group`` (None = the
    default group). ``balancer_kwargs`` go to ``AudioBalancer`` (``cost_model``,
    ``ranks_per_node``, ``mode``, ``tolerance``, ``placement``, ``timeout_s``, ``enabled``).
    Returns the balancer. Applying again replaces the balancer."""
    import transformers
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as mod
    if transformers.__version__ not in TRANSFORMERS_VERSIONS:
        raise RuntimeError(f"odb-factory's Qwen2.5-Omni audio balancing was written for "
                           f"transformers {', '.join(TRANSFORMERS_VERSIONS)}; transformers "
                           f"{transformers.__version__} is installed")
    cls = mod.Qwen2_5OmniThinkerForConditionalGeneration
    if "forward" not in _state:
        _state["forward"] = cls.forward
        _state["get_audio_features"] = cls.get_audio_features
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        _state["forward_params"] = [p.name for p in params if p.kind in (
            p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        cls.forward = _forward
        cls.get_audio_features = _get_audio_features
    _state["balancer"] = AudioBalancer(group, **balancer_kwargs)
    _state["training_only"] = training_only
    return _state["balancer"]


def remove() -> None:
    """Restore upstream ``forward`` and ``get_audio_features`` of the thinker."""
    if "forward" not in _state:
        return
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as mod
    mod.Qwen2_5OmniThinkerForConditionalGeneration.forward = _state["forward"]
    mod.Qwen2_5OmniThinkerForConditionalGeneration.get_audio_features = _state["get_audio_features"]
    _state.clear()
    _stash().clear()
