"""The two row exchanges of every encoder stage, given its plan (``EncoderPlan``):
inputs from their owners to the encoding rank (no autograd: pixels and mel frames get no
gradient), outputs back to their owners (differentiable), each in the plan's orders."""

from __future__ import annotations

from typing import Any

import torch

from odb_factory.balance.encoder_plan import EncoderPlan
from odb_factory.comm.row_exchange import all_to_all_rows


def send_inputs(rows: torch.Tensor, plan: EncoderPlan, rank: int, group: Any, *, what: str,
                step: int, timeout_s: float) -> tuple[torch.Tensor, int]:
    """This rank's input rows (local item order) -> the rows of its share (share order), and
    the bytes this rank sent away."""
    expected = sum(plan.in_rows(rank, i) for i in range(len(plan.encoder[rank])))
    if rows.shape[0] != expected:
        raise ValueError(f"rank {rank}: {what}: {rows.shape[0]} rows given but this rank's "
                         f"items describe {expected}")
    counts = plan.input_send_counts(rank)
    if not plan.is_local(rank):
        rows = rows.index_select(0, torch.as_tensor(plan.input_send_rows(rank), device=rows.device))
    share = all_to_all_rows(rows.detach(), counts, plan.input_recv_counts(rank), group, what=what,
                            step=step, timeout_s=timeout_s)
    sent = (sum(counts) - counts[rank]) * rows[0].numel() * rows.element_size() if len(rows) else 0
    return share, sent


def return_outputs(out: torch.Tensor, plan: EncoderPlan, rank: int, group: Any, *, what: str,
                   step: int, timeout_s: float) -> tuple[torch.Tensor, int]:
    """The tower's output rows of this rank's share (share order) -> the output rows of this
    rank's own items (local order), differentiably, and the bytes this rank sent away."""
    counts = plan.output_send_counts(rank)
    back = all_to_all_rows(out, counts, plan.output_recv_counts(rank), group, what=what,
                           step=step, timeout_s=timeout_s)
    sent = (sum(counts) - counts[rank]) * out[0].numel() * out.element_size() if len(out) else 0
    if not plan.is_local(rank):
        back = back.index_select(0, torch.as_tensor(plan.return_rows(rank), device=back.device))
    return back, sent


def return_outputs_together(parts: list[tuple[torch.Tensor, EncoderPlan]], rank: int, group: Any,
                            *, what: str, step: int, timeout_s: float
                            ) -> tuple[list[torch.Tensor], list[int]]:
    """``return_outputs`` for several stages at once, in one differentiable exchange: the
    stages' output rows (same width) travel to each owner side by side, stage after stage
    within each destination's block. Returns each stage's rows in local order and the bytes
    this rank sent for each."""
    world, stages = parts[0][1].world, len(parts)
    send = [plan.output_send_counts(rank) for _, plan in parts]
    recv = [plan.output_recv_counts(rank) for _, plan in parts]
    blocks = [out.split(counts) for (out, _), counts in zip(parts, send)]
    ordered = torch.cat([blocks[k][d] for d in range(world) for k in range(stages)])
    back = all_to_all_rows(ordered, [sum(c[d] for c in send) for d in range(world)],
                           [sum(c[s] for c in recv) for s in range(world)], group, what=what,
                           step=step, timeout_s=timeout_s)
    pieces = back.split([recv[k][s] for s in range(world) for k in range(stages)])
    outs, sent = [], []
    for k, (out, plan) in enumerate(parts):
        stage = torch.cat([pieces[s * stages + k] for s in range(world)])
        if not plan.is_local(rank):
            stage = stage.index_select(0, torch.as_tensor(plan.return_rows(rank), device=stage.device))
        outs.append(stage)
        sent.append((sum(send[k]) - send[k][rank]) * out[0].numel() * out.element_size() if len(out) else 0)
    return outs, sent
