"""Exact token-level loss scaling for variable-size steps.

With DDP the gradient is averaged over W ranks. If rank r computes the per-token mean loss
over its t_r supervised tokens and multiplies it by w_r = W * t_r / T (T = supervised
tokens of all ranks over the accumulation window), the averaged gradient is
    (1/W) * sum_r W * t_r / T * grad(S_r / t_r) = grad(sum_r S_r) / T,
the gradient of the global per-token mean: what one process would compute on all samples.
`ODBBatch.loss_scale` is that w_r (0 for IDLE steps).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def token_mean_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                    shift: bool = True) -> torch.Tensor:
    """Causal-LM cross entropy averaged over supervised tokens (0 if there are none)."""
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")
    count = labels.ne(ignore_index).sum()
    return total / count.clamp(min=1)


def scaled_loss(step, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                shift: bool = True) -> torch.Tensor:
    """The loss to call backward() on for one ODBBatch under DDP gradient averaging."""
    return token_mean_loss(logits, labels, ignore_index, shift) * step.loss_scale


def weighted_loss(step, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                  shift: bool = True) -> torch.Tensor:
    """`step_mode="samples"`: Σ over rows of (summed token losses × the row's sample weight).
    Under DDP's gradient average this is the fixed-batch run's loss for the same samples."""
    # float64 here; weighted_token_sum casts to the loss's dtype
    weights = torch.as_tensor(step.sample_weights, dtype=torch.float64,
                              device=logits.device)  # pragma: no mutate, CPU tests cannot tell devices apart
    if step.is_idle or weights.numel() == 0:
        return logits.sum() * 0.0  # keeps the graph (and DDP's collectives) of an IDLE step
    return weighted_token_sum(logits, labels, weights, ignore_index, shift)


def supervised_positions(labels: torch.Tensor, ignore_index: int = -100, shift: bool = True) -> torch.Tensor:
    """The positions whose logits the loss reads (1-D, ascending, the union over rows): those
    whose next label (`shift`) or own label is supervised. A model called with these as
    `logits_to_keep` computes no logits for prompt, image or padding positions, whose loss terms
    are zero; at least one position is kept, so an all-prompt batch still has a graph."""
    targets = F.pad(labels[..., 1:], (0, 1), value=ignore_index) if shift else labels
    kept = targets.reshape(-1, targets.size(-1)).ne(ignore_index).any(dim=0).nonzero().squeeze(1)
    return kept if kept.numel() else torch.zeros(1, dtype=torch.long, device=labels.device)


def weighted_token_sum(logits: torch.Tensor, labels: torch.Tensor, row_weights: torch.Tensor,
                       ignore_index: int = -100, shift: bool = True,
                       positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Σ_rows row_weights[r] · Σ_tokens CE over the supervised tokens of row r. Weights shaped
    like `labels` weigh each token instead (a padding-free row holds several samples).
    `positions`: the logits are those of these positions only (`supervised_positions`)."""
    per_token_weights = row_weights.dim() == labels.dim()
    if shift:
        # the labels move left, not the logits: slicing the logits' last position would copy
        # all of them (vocabulary × tokens) into the loss; the last position predicts nothing
        labels = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
        if per_token_weights:
            row_weights = F.pad(row_weights[..., 1:], (0, 1))  # a label's weight is its own sample's
    if positions is not None:
        labels = labels[..., positions]
        if per_token_weights:
            row_weights = row_weights[..., positions]
    per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                ignore_index=ignore_index, reduction="none").view(labels.shape)
    if per_token_weights:
        return (per_token * row_weights.to(per_token.dtype)).sum()
    per_row = per_token.sum(dim=-1)  # pragma: no mutate, per_token is 2-D: dim 1 is dim -1
    return (per_row * row_weights.to(per_token.dtype)).sum()
