"""Per-segment attention for packed rows: each sample's slice of q/k/v through causal
`scaled_dot_product_attention`, no mask at all.

A padding-free row holds several samples. Without flash attention's varlen kernels, transformers
attends over it with a dense (Σ len)² block-causal mask (sdpa and eager): building that mask and
the attention over it cost (Σ len)², and on CPU they dominate a long row's step. Attention is the
only operation of a decoder that mixes tokens, so computing it per sample — and everything else
(projections, MLP, norms, the loss) once over the whole row — gives each sample exactly what it
gets alone, at Σ len² attention cost, on any device and dtype, with gradient checkpointing and
ZeRO (nothing here holds state).

The segments come from the FlashAttention keyword arguments transformers models pass down to
their attention functions (`cu_seq_lens_q`: cumulative sample lengths over the row's tokens, the
layout flash varlen reads), which `pack_group` puts in every packed batch. Registered under
`SEGMENT_ATTENTION` with transformers' `AttentionInterface` and `AttentionMaskInterface`; no
modeling file is patched. Called without segments (a padded batch: evaluation, the vision tower)
it is transformers' own sdpa, with transformers' own mask.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

SEGMENT_ATTENTION = "odb_segments"
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def segment_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                              dropout: float = 0.0, scaling: Optional[float] = None,
                              is_causal: Optional[bool] = None,
                              cu_seq_lens_q: Optional[torch.Tensor] = None,
                              cu_seq_lens_k: Optional[torch.Tensor] = None,
                              **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (batch, heads, len, dim), key/value
    (batch, kv_heads, len, dim); returns ((batch, len, heads, dim), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if attention_mask is not None:
        raise ValueError("segment attention: a packed row carries no attention mask (its samples are "
                         "given by cu_seq_lens_q)")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("segment attention: queries and keys must share their segments (no cache)")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("segment attention: sliding-window layers are not supported; "
                                  "use flash attention or odb_packed_attention: mask")
    batch, heads, length, dim = query.shape
    bounds = [int(b) for b in cu_seq_lens_q.tolist()]
    if bounds[0] != 0 or bounds[-1] != batch * length or any(b > a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"segment attention: cu_seq_lens_q {bounds} does not cut the {batch}x{length} "
                         "tokens of the batch into consecutive segments")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)

    def tokens_along_dim2(t: torch.Tensor) -> torch.Tensor:  # (batch, h, len, d) -> (1, h, batch*len, d)
        return t if batch == 1 else t.transpose(0, 1).reshape(1, t.shape[1], batch * length, t.shape[-1])

    # split, not slices: the backward of a split is one concatenation, while each slice's
    # backward would write its gradient into a zero tensor the size of the whole row
    sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
    splits = [tokens_along_dim2(t).split(sizes, dim=2) for t in (query, key, value)]
    pieces = [sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=causal)[0]
              for q, k, v in zip(*splits)]
    return torch.cat(pieces, dim=1).reshape(batch, length, heads, dim), None


def segment_attention_mask(*args: Any, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any):
    """No mask for a packed row (the attention function reads its segments); transformers' sdpa
    mask for a padded batch."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Make `SEGMENT_ATTENTION` a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention_forward)
    AttentionMaskInterface.register(SEGMENT_ATTENTION, segment_attention_mask)
    return SEGMENT_ATTENTION


def decoder_config(model: torch.nn.Module) -> Any:
    """The config the model's language decoder reads its attention implementation from: the
    `text_config` of a vision-language model, else the model's own."""
    config = model.config
    return getattr(config, "text_config", None) or config


def packed_attention(model: torch.nn.Module, choice: str = "auto") -> str:
    """The attention a packed row of `model` will run, after switching the decoder to it:
    'varlen' (the model runs flash attention, which reads the same segments), 'segments'
    (per-segment sdpa, registered here) or 'mask' (transformers' dense block-causal mask,
    left as it is). `choice`: `odb_packed_attention`."""
    config = decoder_config(model)
    current = getattr(config, "_attn_implementation", None)
    if current in FLASH_IMPLEMENTATIONS:
        return "varlen"
    if choice == "mask":
        return "mask"
    config._attn_implementation = register()
    return "segments"
