"""What the training loop receives for one step."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List


def _renamed(old: str, new: str) -> property:
    """A name of 0.1.0, kept as a deprecated alias of `new` through 0.2.x (CHANGELOG.md)."""
    def read(self: "ODBBatch") -> Any:
        # stacklevel 2: the line that read the old name
        warnings.warn(f"ODBBatch.{old} is deprecated (renamed {new} in 0.2.0; the old name goes "
                      f"in 0.3.0): read ODBBatch.{new}", DeprecationWarning, stacklevel=2)
        return getattr(self, new)
    return property(read)


@dataclass
class ODBBatch:
    """One step on this rank.

    data: the collate function's output for this rank's group (for an IDLE step, a
        one-sample filler batch whose loss must be multiplied by `loss_scale` = 0: the step
        still runs forward/backward so DDP/ZeRO collectives stay aligned).
    indices: dataset indices trained on this rank in this step ([] when idle).
    label_tokens: supervised tokens (labels != ignore_index) of this rank's group.
    global_label_tokens: supervised tokens of all ranks over this step's gradient-accumulation
        window (the exact loss denominator).
    vision_patches: vision-encoder patches of this rank's group (as the loader placed it).
    audio_frames: valid audio mel frames of this rank's group (as the loader placed it).
    loss_scale: multiply this rank's per-token *mean* loss by it; with DDP's gradient
        average the result is the gradient of the global per-token mean (docs/dgap.md).
    sample_weights: step_mode="samples": per sample of `data`, the weight of its summed token
        losses in the fixed-batch run's loss (`odb_factory.loss.weighted_loss`).
    optimizer_step_end: the last micro-step of an optimizer step (step the optimizer after it).
    """
    data: Any
    indices: List[int]
    label_tokens: int
    global_label_tokens: int
    loss_scale: float
    is_idle: bool
    epoch: int
    step: int
    input_tokens: int = 0
    padded_tokens: int = 0
    vision_patches: int = 0
    audio_frames: int = 0
    global_num_samples: int = 0
    metrics: Dict[str, float] = field(default_factory=dict)
    sample_weights: List[float] = field(default_factory=list)
    optimizer_step_end: bool = False

    num_tokens = _renamed("num_tokens", "label_tokens")
    global_num_tokens = _renamed("global_num_tokens", "global_label_tokens")
    num_input_tokens = _renamed("num_input_tokens", "input_tokens")

    @property
    def num_samples(self) -> int:
        return len(self.indices)
