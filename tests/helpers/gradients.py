"""Gradient comparisons for the multi-rank equivalence tests (run inside the ranks)."""

from __future__ import annotations


def summed_grads(module):
    """Every parameter's gradient summed over the default group (what DDP all-reduces, before
    its division), zeros where a parameter got none; then clears the gradients."""
    import torch
    import torch.distributed as dist
    out = {}
    for n, p in module.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        out[n] = g
    module.zero_grad(set_to_none=True)
    return out


def worst_rel_err(a, b):
    """The largest of max|a - b| / max|b| over the tensors of ``b`` (absolute where b is 0)."""
    worst = 0.0
    for n in b:
        scale = float(b[n].abs().max())
        err = float((a[n] - b[n]).abs().max())
        worst = max(worst, err / scale if scale > 0 else err)
    return worst
