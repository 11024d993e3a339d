"""step_mode="samples" on real gloo ranks, fp64: every optimizer step trains exactly the
fixed-batch run's samples, every rank runs the same number of micro-batches, and the
step's DDP gradient equals the fixed-batch step's, for both of Standard's normalizations."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_world

N = 53                    # uneven: the last global batch wraps around, the last step is short


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(97, 8), torch.nn.Linear(8, 97)).double()


def _dataset():
    from odb_factory.synthetic import LengthDataset, long_tail_lengths
    return LengthDataset(long_tail_lengths(N, cv=1.0, mean=40, seed=3, maximum=300))


def _standard_grads(world, batch_size, accumulation, normalization):
    """Fixed-batch DDP run, computed in one process: per optimizer step, the average over
    ranks of each rank's loss (micro_mean: mean over micro-batches of token means;
    exact: W × summed token losses / all ranks' tokens)."""
    import torch
    from odb_factory.loss import token_mean_loss
    from odb_factory.planning.optimizer_steps import fixed_batch_steps
    from odb_factory.synthetic import pad_collate
    ds = _dataset()
    plans = [fixed_batch_steps(N, world, r, batch_size, accumulation, seed=0, epoch=0) for r in range(world)]
    out = []
    for k in range(len(plans[0])):
        model = _model()
        batches = [[pad_collate([ds[i] for i in mb]) for mb in plans[r][k].micro_batches] for r in range(world)]
        total_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for rank in batches for b in rank)
        loss = 0
        for rank in batches:
            for b in rank:
                logits = model(b["input_ids"])
                if normalization == "micro_mean":
                    loss = loss + token_mean_loss(logits, b["labels"]) / len(rank) / world
                else:
                    loss = loss + token_mean_loss(logits, b["labels"]) * int(
                        (b["labels"][:, 1:] != -100).sum()) / total_tokens
        loss.backward()
        out.append((sorted(i for r in range(world) for i in plans[r][k].indices),
                    torch.cat([p.grad.flatten() for p in model.parameters()])))
    return out


def _odb_rank(rank, world, batch_size, accumulation, normalization, budget, relayout=""):
    import torch
    import torch.distributed as dist
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.loss import weighted_loss
    from odb_factory.synthetic import pad_collate
    cfg = ODBConfig(step_mode="samples", loss_scaling=normalization, token_budget=budget,
                    standard_batch_size=batch_size, gradient_accumulation_steps=accumulation,
                    balance="balance" in relayout, balance_mode="lpt", global_grouping="global" in relayout)
    loader = ODBDataLoader(_dataset(), cfg, collate_fn=pad_collate)
    model = _model()
    steps, indices, micro = [], [], 0
    for step in loader:
        loss = weighted_loss(step, model(step.data["input_ids"]), step.data["labels"])
        loss.backward()
        indices += step.indices
        micro += 1
        if step.optimizer_step_end:
            grad = torch.cat([p.grad.flatten() for p in model.parameters()])
            dist.all_reduce(grad)          # what DDP does, then divides by the world size
            steps.append((indices, micro, (grad / world).tolist()))
            model.zero_grad()
            indices, micro = [], 0
    loader.close()
    return steps


@pytest.mark.parametrize("world,batch_size,accumulation,normalization,budget,relayout", [
    (2, 1, 4, "micro_mean", 256, ""),
    (2, 2, 3, "exact", 384, ""),
    (3, 2, 2, "micro_mean", 300, ""),
    (3, 2, 3, "micro_mean", 600, "balance"),  # post-balanced: samples move, their weights with them
    (3, 2, 3, "exact", 600, "global+balance"),  # global grouping over the step's samples, then balanced
])
def test_samples_mode_step_equals_the_fixed_batch_step(world, batch_size, accumulation, normalization, budget,
                                                       relayout):
    import torch
    standard = _standard_grads(world, batch_size, accumulation, normalization)
    ranks = run_world(_odb_rank, world, batch_size, accumulation, normalization, budget, relayout, timeout=240)
    assert all(len(r) == len(standard) for r in ranks), "a different number of optimizer steps"
    packed = 0
    for k, (indices, reference) in enumerate(standard):
        micro = {r[k][1] for r in ranks}
        assert len(micro) == 1, f"step {k}: ranks ran different micro-batch counts {micro}"
        assert sorted(i for r in ranks for i in r[k][0]) == indices, f"step {k}: other samples"
        got = torch.tensor(ranks[0][k][2], dtype=torch.float64)
        assert float((got - reference).norm() / reference.norm()) < 1e-10, f"step {k}"
        packed += micro.pop() < accumulation
    assert packed > 0, "no step was packed into fewer micro-batches than the fixed-batch run"
    if relayout:  # the re-layout must have moved samples off the rank Standard gives them
        from odb_factory.planning.optimizer_steps import fixed_batch_steps
        plans = [fixed_batch_steps(N, world, r, batch_size, accumulation, seed=0, epoch=0) for r in range(world)]
        moved = sum(len(set(ranks[r][k][0]) - set(plans[r][k].indices))
                    for r in range(world) for k in range(len(standard)))
        assert moved > 0, f"{relayout} moved no sample"
