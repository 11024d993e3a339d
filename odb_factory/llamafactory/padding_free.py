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
- `odb_token_sample`: per token, the sample it belongs to (-1: the collator's placeholder image,
  padding), for the per-sample loss weights of `odb_step: samples`;
- `cu_seq_lens_q/k`, `max_length_q/k`: the segments of the row (each sample, the placeholder,
  a padding block) as cumulative lengths over the batch's flattened tokens, the keyword arguments
  transformers models pass down to their attention: flash attention runs them as varlen calls,
  `odb_factory.segment_attention` as one causal sdpa call per segment, without a mask.

`odb_padding_free_row_tokens` cuts a group into several such rows (each sample whole), the
shorter rows completed by a padding block of their own: sdpa/eager then build one (row length)²
mask per row instead of one (Σ len)² mask.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

IGNORE_INDEX = -100
TOKEN_SAMPLE_KEY = "odb_token_sample"

# model_type -> position layout. Verified in fp64 against the padded batch (per-sample losses and
# gradients) on transformers 4.57 and 5.6: tests/llamafactory/test_padding_free.py.
PACKABLE_MODEL_TYPES = MappingProxyType({"qwen3_vl": "mrope", "qwen2_5_vl": "mrope", "qwen3": "text", "llama": "text"})
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


def _rows(pieces, row_tokens: Optional[int]) -> List[list]:
    """The pieces, in order, cut into rows of at most `row_tokens` tokens (a longer piece gets a
    row of its own); one row without a limit."""
    if row_tokens is None:
        return [list(pieces)]
    rows: List[list] = [[]]
    used = 0
    for piece in pieces:
        size = piece[2] - piece[1]
        if rows[-1] and used + size > row_tokens:
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += size
    return rows


def pack_group(batch: Dict[str, Any], lengths: Sequence[int], placeholder: int = 0,
               row_tokens: Optional[int] = None, pad_token_id: int = 0) -> Dict[str, Any]:
    """The collator's padded `batch` (right padding) as padding-free rows: one row, or rows of
    at most `row_tokens` tokens (each sample whole, in order), the shorter ones completed by a
    padding block of their own (labels -100, positions restarting, `odb_token_sample` -1).

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
    out_rows = _rows(_segments(lengths, placeholder), row_tokens)
    length = max(sum(end - start for _, start, end, _ in r) for r in out_rows)

    def assemble(piece_of, pad_of, dim: int = 0) -> torch.Tensor:
        """Each output row: its pieces then padding, along `dim`; rows stacked before `dim`."""
        built = []
        for r in out_rows:
            parts = [piece_of(piece) for piece in r]
            missing = length - sum(end - start for _, start, end, _ in r)
            if missing:
                parts.append(pad_of(missing))
            built.append(torch.cat(parts, dim=dim))
        return torch.stack(built, dim=dim)

    def arange(n: int) -> torch.Tensor:
        return torch.arange(n)

    packed: Dict[str, Any] = {}
    for key, value in batch.items():
        if key in DROPPED_KEYS:
            continue
        if key == "position_ids":
            packed[key] = _pack_positions(value, rows, width, assemble)
        elif torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, width):
            fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX}.get(key, 0)
            packed[key] = assemble(
                lambda piece, value=value: _first_label_masked(key, value[piece[0], piece[1]:piece[2]]),
                lambda n, value=value, fill=fill: torch.full((n, *value.shape[2:]), fill, dtype=value.dtype))
        else:
            packed[key] = value
    if "position_ids" not in packed:
        packed["position_ids"] = assemble(lambda piece: arange(piece[2] - piece[1]), arange)
    packed[TOKEN_SAMPLE_KEY] = assemble(
        lambda piece: torch.full((piece[2] - piece[1],), piece[3], dtype=torch.long),
        lambda n: torch.full((n,), -1, dtype=torch.long))
    packed.update(segment_lengths_kwargs(out_rows, length))
    packed["use_cache"] = False  # a cache makes transformers skip the packed-sequence detection
    return packed


def segment_lengths_kwargs(out_rows: Sequence[list], length: int) -> Dict[str, Any]:
    """FlashAttention's varlen keyword arguments for rows of `length` tokens: every piece, and
    each row's padding block, a segment of its own, over the rows' tokens laid end to end."""
    bounds = [0]
    for r in out_rows:
        for _, start, end, _ in r:
            bounds.append(bounds[-1] + end - start)
        if bounds[-1] % length:  # the row's padding block
            bounds.append(bounds[-1] + length - bounds[-1] % length)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    cumulative = torch.tensor(bounds, dtype=torch.int32)  # flash attention's dtype
    return {"cu_seq_lens_q": cumulative, "cu_seq_lens_k": cumulative,
            "max_length_q": longest, "max_length_k": longest}


def _first_label_masked(key: str, values: torch.Tensor) -> torch.Tensor:
    """A sample's first label is masked: nothing predicts it from the previous sample's tokens."""
    if key != "labels":
        return values
    values = values.clone()
    values[:1] = IGNORE_INDEX
    return values


def _pack_positions(positions: torch.Tensor, rows: int, width: int, assemble) -> torch.Tensor:
    def plain(n: int) -> torch.Tensor:
        return torch.arange(n, dtype=positions.dtype)
    if positions.dim() == 2:  # (rows, width): text models
        return assemble(lambda piece: plain(piece[2] - piece[1]), plain)
    if positions.dim() != 3 or tuple(positions.shape[1:]) != (rows, width):
        raise ValueError(f"pack_group: position_ids of shape {tuple(positions.shape)} for a batch of "
                         f"{rows}x{width}")
    rope = positions[-3:]  # the multimodal rows (t, h, w); a 4-row layout has the text row first

    def piece_positions(piece) -> torch.Tensor:
        row, start, end, sample = piece
        text = plain(end - start).unsqueeze(0)
        if sample < 0:  # the placeholder: its own block, any valid positions
            return text.expand(4, -1)
        return torch.cat([text, rope[:, row, start:end]])
    return assemble(piece_positions, lambda n: plain(n).expand(4, -1), dim=1)


def counted_tokens(batch: Dict[str, Any]) -> Dict[str, Any]:
    """What HF counts as a batch's tokens seen: a packed row's real tokens are its samples' (an
    attention mask of them), not the placeholder image's or a padding block's, as a padded
    batch's attention mask says."""
    token_sample = batch.get(TOKEN_SAMPLE_KEY)
    if token_sample is None:
        return batch
    return {"input_ids": batch["input_ids"], "attention_mask": (token_sample >= 0).long()}


def token_weights(sample_weights: Sequence[float], token_sample: torch.Tensor) -> torch.Tensor:
    """Per token of packed rows, its sample's loss weight (0 for the placeholder and padding)."""
    weights = torch.as_tensor(list(sample_weights) + [0.0], dtype=torch.float32)
    return weights[torch.where(token_sample >= 0, token_sample, len(sample_weights))]


class PackedCollate:
    """`collate(features)` (LLaMA-Factory's collator, with each row's first label masked) then
    `pack_group`."""

    def __init__(self, collate: Callable[[List[Dict[str, Any]]], Dict[str, Any]],
                 row_tokens: Optional[int] = None, pad_token_id: int = 0):
        self.collate = collate
        self.row_tokens = row_tokens
        self.pad_token_id = pad_token_id

    def __call__(self, features: List[Dict[str, Any]]) -> Dict[str, Any]:
        lengths = [len(f["input_ids"]) for f in features]
        batch = self.collate(features)
        # LLaMA-Factory's collator appends its placeholder image's tokens to the first feature
        placeholder = len(features[0]["input_ids"]) - lengths[0]
        return pack_group(batch, lengths, placeholder, self.row_tokens, self.pad_token_id)
