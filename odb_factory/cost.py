"""Cost observation: what a processed sample costs, measured after the real pipeline.

A cost function takes one processed sample (the dataset's `__getitem__` output, after
templating, tokenisation and vision-token expansion) and returns a `SampleCost`. It runs in
the DataLoader workers, next to the pipeline, so it must be picklable (a module-level
function or a class instance, not a lambda, under the spawn start method).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy


class SampleCost(NamedTuple):
    input_tokens: int        # LLM input tokens: what the padded/packed budget is made of
    label_tokens: int        # supervised tokens (labels != ignore_index): the loss denominator
    vision_patches: int = 0  # vision-encoder patches (before spatial merge)
    audio_frames: int = 0    # valid mel frames of the sample's audio clips


CostFn = Callable[[Any], SampleCost]

# Qwen2.5-Omni's audio tower halves the frames twice (a stride-2 convolution, then pooling):
# one audio token in the text stands for about four mel frames.
FRAMES_PER_AUDIO_TOKEN = 4
AUDIO_MASK_KEY = "feature_attention_mask"


class MissingCostKeyError(LookupError):
    """A sample lacks the key the cost function reads."""


def _length(value: Any) -> int:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[-1]) if len(shape) else 1
    return len(value)


def _host_array(values: Any) -> numpy.ndarray:
    """`values` as a numpy array: a CPU tensor's view (no copy; counting on it is ~3x faster
    than torch's per-op dispatch, at one call per sample; `.numpy()` skips the detour through
    `Tensor.__array__`), a list converted, a copy of a tensor numpy cannot view (on an
    accelerator, bfloat16)."""
    to_numpy = getattr(values, "numpy", None)
    if to_numpy is None:
        return numpy.asarray(values)
    try:
        return to_numpy()
    except (RuntimeError, TypeError):
        return numpy.asarray(values.detach().cpu().long())


def _count_not_equal(values: Any, ignore_index: int) -> int:
    return int(numpy.count_nonzero(_host_array(values) != ignore_index))


def _count_in(values: Any, token_ids: Sequence[int]) -> int:
    return int(numpy.count_nonzero(numpy.isin(_host_array(values), list(token_ids))))


class DefaultCost:
    """LLM tokens = len(input_ids); supervised tokens = #(labels[1:] != ignore_index)
    (the tokens a shifted causal-LM loss averages over; label_shift=False counts all);
    vision patches from `image_grid_thw` (sum of t*h*w) or, when the sample carries no grid,
    `#(vision pad tokens) * spatial_merge_size**2`; audio frames from `feature_attention_mask`
    (its valid frames) or, without it, `#(audio tokens) * FRAMES_PER_AUDIO_TOKEN`."""

    def __init__(self, length_key: str = "input_ids", label_key: Optional[str] = "labels",
                 ignore_index: int = -100, image_grid_key: str = "image_grid_thw",
                 vision_token_ids: Sequence[int] = (), spatial_merge_size: int = 2,
                 label_shift: bool = True, audio_token_ids: Sequence[int] = ()):
        self.length_key = length_key
        self.label_key = label_key
        self.ignore_index = ignore_index
        self.image_grid_key = image_grid_key
        self.vision_token_ids = tuple(vision_token_ids)
        self.spatial_merge_size = spatial_merge_size
        self.label_shift = label_shift
        self.audio_token_ids = tuple(audio_token_ids)

    @classmethod
    def from_config(cls, config) -> "DefaultCost":
        return cls(config.length_key, config.label_key, config.ignore_index,
                   config.image_grid_key, config.vision_token_ids, config.spatial_merge_size,
                   config.label_shift, config.audio_token_ids)

    def __call__(self, sample: Any) -> SampleCost:
        try:
            ids = sample[self.length_key]
        except (KeyError, TypeError, IndexError) as exc:
            keys = list(sample.keys()) if hasattr(sample, "keys") else type(sample).__name__
            raise MissingCostKeyError(
                f"sample has no '{self.length_key}' to measure its length (it has: {keys}); "
                f"set ODBConfig.length_key or pass cost_fn=") from exc
        tokens = _length(ids)
        label_tokens = tokens
        get = getattr(sample, "get", None)
        labels = get(self.label_key) if get is not None and self.label_key is not None else None
        if labels is not None:
            labels = _host_array(labels)
            # A causal LM predicts token i+1 from i: the first label never enters the loss.
            label_tokens = _count_not_equal(labels[1:] if self.label_shift else labels,
                                            self.ignore_index)
        patches = 0
        grid = get(self.image_grid_key) if get is not None else None
        if grid is not None:
            rows = grid.tolist() if hasattr(grid, "tolist") else grid
            if rows and not isinstance(rows[0], (list, tuple)):
                rows = [rows]
            patches = sum(int(t) * int(h) * int(w) for t, h, w in rows)
        elif self.vision_token_ids:
            patches = _count_in(ids, self.vision_token_ids) * self.spatial_merge_size ** 2
        frames = 0
        mask = get(AUDIO_MASK_KEY) if get is not None else None
        if mask is not None:
            frames = int(numpy.count_nonzero(_host_array(mask)))
        elif self.audio_token_ids:
            frames = _count_in(ids, self.audio_token_ids) * FRAMES_PER_AUDIO_TOKEN
        return SampleCost(tokens, label_tokens, patches, frames)
