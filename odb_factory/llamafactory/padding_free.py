"""Padding-free groups (`odb_padding_free: true`): a collated group trained as one flattened row.

LLaMA-Factory's collator pads the group as usual (it also processes the images and computes
each sample's multimodal rope positions); `pack_group` then keeps each row's real tokens and
concatenates them. Without an attention mask, transformers reads the restarts of the text
position ids and builds block-causal attention (sdpa/eager: a dense (Σ len)² mask; flash
attention: varlen calls), so no sample sees another and the group costs `Σ len` tokens.

Layout of the row (checked equal to the padded batch in fp64, tests/llamafactory/test_padding_free.py):
- input ids, labels and any other per-token tensor: the samples' real tokens, in sample order;
  each sample's first label is masked so no sample predicts across a boundary;
- position ids: text models (1, Σ len), each sample's `arange` concatenated; Qwen-VL models
  (4, 1, Σ len): row 0 the same plain per-sample `arange` (LLaMA-Factory copies the temporal rope
  row there, whose constant runs inside an image would read as sample boundaries), rows 1-3 each
  sample's rope positions as computed for it alone (the collator computes them per row, from the
  row's real tokens);
- no attention mask, no cache, no `rope_deltas` (generation only); images, videos and their grids
  stay concatenated in sample order, as the collator made them;
- `odb_token_sample`: per token, the sample it belongs to (-1: the collator's placeholder image),
  for the per-sample loss weights of `odb_step: samples`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

IGNORE_INDEX = -100
TOKEN_SAMPLE_KEY = "odb_token_sample"

# model_type -> position layout. Verified in fp64 against the padded batch (per-sample losses and
# gradients) on transformers 4.57 and 5.6: tests/llamafactory/test_padding_free.py.
PACKABLE_MODEL_TYPES = {"qwen3_vl": "mrope", "qwen2_5_vl": "mrope", "qwen3": "text", "llama": "text"}
# Dropped from a packed row: the mask (its absence is what makes transformers read the position
# restarts) and the rope offsets generation uses.
DROPPED_KEYS = ("attention_mask", "rope_deltas")


def padding_free_refusal(model_type: Optional[str]) -> Optional[str]:
    """Why a model of this type cannot train padding-free rows (None: it can)."""
    if model_type in PACKABLE_MODEL_TYPES:
        return None
    return (f"odb_padding_free: true: packed rows are verified for {sorted(PACKABLE_MODEL_TYPES)}; "
            f"this model is '{model_type}' (its forward may not read sample boundaries from the "
            "position ids). Set odb_padding_free: false")


def _segments(lengths: Sequence[int], placeholder: int) -> List[Tuple[int, int, int, int]]:
    """(row, start, end, sample) of every piece of the packed row: each row's real tokens, then
    the collator's placeholder image tokens (appended to row 0 after its real tokens) as a
    piece of their own (sample -1)."""
    pieces = [(row, 0, int(n), row) for row, n in enumerate(lengths)]
    if placeholder:
        pieces.append((0, int(lengths[0]), int(lengths[0]) + placeholder, -1))
    return pieces


def _text_positions(pieces) -> torch.Tensor:
    return torch.cat([torch.arange(end - start) for _, start, end, _ in pieces])


def pack_group(batch: Dict[str, Any], lengths: Sequence[int], placeholder: int = 0) -> Dict[str, Any]:
    """The collator's padded `batch` (right padding) as one padding-free row.

    lengths: real tokens of each row (the samples' `input_ids` lengths);
    placeholder: tokens the collator appended to row 0 after its real tokens (the fake image it
        adds to a multimodal group without any image, so every rank runs the vision tower)."""
    input_ids = batch["input_ids"]
    rows, width = input_ids.shape
    if len(lengths) != rows:
        raise ValueError(f"pack_group: {len(lengths)} lengths for a batch of {rows} rows")
    if lengths[0] + placeholder > width or max(lengths) > width:
        raise ValueError(f"pack_group: lengths {list(lengths)} (+{placeholder}) exceed the batch width {width}")
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        for row, n in enumerate(lengths):
            if not bool(mask[row, :n].all()):
                raise ValueError("pack_group: a row's real tokens are not its first tokens (left padding?); "
                                 "padding-free rows need the tokenizer's padding_side: right")
    pieces = _segments(lengths, placeholder)
    packed: Dict[str, Any] = {}
    for key, value in batch.items():
        if key in DROPPED_KEYS:
            continue
        if key == "position_ids":
            packed[key] = _pack_positions(value, pieces, rows, width)
        elif torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, width):
            packed[key] = torch.cat([value[row, start:end] for row, start, end, _ in pieces]).unsqueeze(0)
        else:
            packed[key] = value
    labels = packed.get("labels")
    if labels is not None:
        starts = torch.tensor([0] + [end - start for _, start, end, _ in pieces[:-1]]).cumsum(0)
        labels[0, starts] = IGNORE_INDEX  # no sample predicts the next sample's first token
    if "position_ids" not in packed:
        packed["position_ids"] = _text_positions(pieces).unsqueeze(0)
    packed[TOKEN_SAMPLE_KEY] = torch.cat(
        [torch.full((end - start,), sample, dtype=torch.long) for _, start, end, sample in pieces]).unsqueeze(0)
    packed["use_cache"] = False  # a cache makes transformers skip the packed-sequence detection
    return packed


def _pack_positions(positions: torch.Tensor, pieces, rows: int, width: int) -> torch.Tensor:
    text = _text_positions(pieces)
    if positions.dim() == 2:  # (rows, width): text models
        return text.unsqueeze(0)
    if positions.dim() != 3 or tuple(positions.shape[1:]) != (rows, width):
        raise ValueError(f"pack_group: position_ids of shape {tuple(positions.shape)} for a batch of "
                         f"{rows}x{width}")
    rope = positions[-3:]  # the multimodal rows (t, h, w); a 4-row layout has the text row first
    parts = []
    for row, start, end, sample in pieces:
        if sample < 0:  # placeholder: its own block, any valid positions
            parts.append(torch.arange(end - start).expand(3, -1))
        else:
            parts.append(rope[:, row, start:end])
    return torch.cat([text.unsqueeze(0), torch.cat(parts, dim=1).to(text.dtype)]).unsqueeze(1)


def token_weights(sample_weights: Sequence[float], token_sample: torch.Tensor) -> torch.Tensor:
    """Per token of a packed row, its sample's loss weight (0 for the placeholder's tokens)."""
    weights = torch.as_tensor(list(sample_weights) + [0.0], dtype=torch.float32)
    return weights[torch.where(token_sample >= 0, token_sample, len(sample_weights))]


class PackedCollate:
    """`collate(features)` (LLaMA-Factory's collator, with each row's first label masked) then
    `pack_group`."""

    def __init__(self, collate: Callable[[List[Dict[str, Any]]], Dict[str, Any]]):
        self.collate = collate

    def __call__(self, features: List[Dict[str, Any]]) -> Dict[str, Any]:
        lengths = [len(f["input_ids"]) for f in features]
        batch = self.collate(features)
        # LLaMA-Factory's collator appends its placeholder image's tokens to the first feature
        placeholder = len(features[0]["input_ids"]) - lengths[0]
        return pack_group(batch, lengths, placeholder)
