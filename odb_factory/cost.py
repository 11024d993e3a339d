"""Cost observation: what a processed sample costs, measured after the real pipeline.

A cost function takes one processed sample (the dataset's `__getitem__` output, after
templating, tokenisation and vision-token expansion) and returns a `SampleCost`. It runs in
the DataLoader workers, next to the pipeline, so it must be picklable (a module-level
function or a class instance, not a lambda, under the spawn start method).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import numpy
import torch


class SampleCost(NamedTuple):
    input_tokens: int        # LLM input tokens: what the padded/packed budget is made of
    label_tokens: int        # supervised tokens (labels != ignore_index): the loss denominator
    vision_patches: int = 0  # vision-encoder patches (before spatial merge)
    audio_frames: int = 0    # valid mel frames of the sample's audio clips


CostFn = Callable[[Any], SampleCost]


class InvalidCostError(ValueError):
    """A cost function returned a count the planner cannot plan with (names sample and value)."""


def checked_cost(cost: Any, index: int) -> SampleCost:
    """`cost` as a SampleCost of whole counts: at least 1 LLM input token (a sample is its
    input_ids), the rest 0 or more. Integral floats are accepted as their integer; anything
    else (0 tokens, negative, fractional, NaN, not a number) is refused naming dataset sample
    `index` and the value, since the planner would form groups far over the budget with it."""
    if type(cost) is not SampleCost:
        try:
            cost = SampleCost(*cost)  # a user cost function may return a plain tuple
        except TypeError:
            raise InvalidCostError(f"dataset sample {index}: the cost function returned {cost!r}, not a "
                                   "SampleCost(input_tokens, label_tokens, vision_patches, audio_frames)") from None
    counts = []
    for name, value in zip(SampleCost._fields, cost):
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        whole = number and isinstance(value, numbers.Integral)
        if number and not whole and math.isfinite(value) and float(value).is_integer():
            value, whole = int(value), True
        least = 1 if name == "input_tokens" else 0
        if not whole or value < least:
            raise InvalidCostError(f"dataset sample {index}: the cost function returned {name}={value!r}; "
                                   f"costs are whole counts, {name} at least {least} ({cost!r})")
        counts.append(int(value))
    return SampleCost(*counts)

# Qwen2.5-Omni's audio tower halves the frames twice (a stride-2 convolution, then pooling):
# one audio token in the text stands for about four mel frames.
FRAMES_PER_AUDIO_TOKEN = 4
AUDIO_MASK_KEY = "feature_attention_mask"


def padded_length(tokens: int, multiple: int) -> int:
    """`tokens` rounded up to a multiple of `multiple`, as a padding collator pads a row (the one
    definition the grouping and the post-balancing plan with)."""
    return -(-tokens // multiple) * multiple  # ceil in integers, exact at any size


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
        return self._cost(sample, None)

    def many(self, samples: Sequence[Any]) -> List[SampleCost]:
        """[self(s) for s in samples], counting the labels of all of them in one pass when
        they are 1-D CPU integer tensors (one numpy call per sample costs more than its count).
        The loader asks it of each chunk of samples it fetches."""
        if type(self).__call__ is not DefaultCost.__call__:  # a subclass measures its own way
            return [self(s) for s in samples]
        labels = [self._labels(s) for s in samples]
        counts = _label_counts(labels, self.ignore_index, self.label_shift)
        if counts is None:
            return [self._cost(s, None) for s in samples]
        return [self._cost(s, c) for s, c in zip(samples, counts)]

    def _labels(self, sample: Any) -> Any:
        get = getattr(sample, "get", None)
        return get(self.label_key) if get is not None and self.label_key is not None else None

    def _cost(self, sample: Any, label_tokens: Optional[int]) -> SampleCost:
        """The sample's cost; `label_tokens`: its supervised tokens, when counted already."""
        try:
            ids = sample[self.length_key]
        except (KeyError, TypeError, IndexError) as exc:
            keys = list(sample.keys()) if hasattr(sample, "keys") else type(sample).__name__
            raise MissingCostKeyError(
                f"sample has no '{self.length_key}' to measure its length (it has: {keys}); "
                f"set ODBConfig.length_key or pass cost_fn=") from exc
        tokens = _length(ids)
        get = getattr(sample, "get", None)
        if label_tokens is None:
            label_tokens = tokens
            labels = self._labels(sample)
            if labels is not None:
                labels = _host_array(labels)
                # A causal LM predicts token i+1 from i: the first label never enters the loss
                # (of each row: a batched (1, n) sample shifts along its last dimension).
                label_tokens = _count_not_equal(labels[..., 1:] if self.label_shift else labels,
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


def _label_counts(labels: Sequence[Any], ignore_index: int, shift: bool) -> Optional[List[int]]:
    """Supervised tokens of each label tensor, counted over their concatenation; None
    unless every one is a 1-D CPU integer tensor of one dtype (then each sample counts alone)."""
    first = labels[0] if labels else None
    if not isinstance(first, torch.Tensor) or first.is_floating_point():
        return None
    if not all(isinstance(t, torch.Tensor) and t.ndim == 1 and t.dtype == first.dtype and t.is_cpu
               for t in labels):
        return None
    lengths = numpy.fromiter((t.shape[0] for t in labels), dtype=numpy.int64)
    starts = numpy.cumsum(lengths) - lengths
    supervised = torch.cat(labels).numpy() != ignore_index
    nonempty = lengths > 0
    counts = numpy.zeros(len(labels), dtype=numpy.int64)
    if nonempty.any():
        # each non-empty sample's sum runs to the next non-empty sample's start: its own labels
        first_labels = starts[nonempty]
        counts[nonempty] = numpy.add.reduceat(supervised, first_labels)  # bools sum as int64
        if shift:  # the first label of each sample never enters the loss
            counts[nonempty] -= supervised[first_labels]
    return counts.tolist()
