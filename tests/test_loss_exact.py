"""fp64: ODB-scaled losses under DDP give the gradient of the global per-token mean."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_world


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(97, 8), torch.nn.Linear(8, 97)).double()


def _reference_grad(samples):
    """One process, all of the window's samples: grad of sum(CE) / #supervised tokens."""
    import torch
    from odb_factory.loss import token_mean_loss
    from odb_factory.synthetic import pad_collate
    model = _model()
    batch = pad_collate(samples)
    loss = token_mean_loss(model(batch["input_ids"]), batch["labels"])
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _rank(rank, world, accumulation):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.loss import scaled_loss
    from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate

    ds = LengthDataset(long_tail_lengths(61, cv=1.0, mean=40, seed=3, maximum=300))
    cfg = ODBConfig(token_budget=256, buffer_size=12, gradient_accumulation_steps=accumulation)
    loader = ODBDataLoader(ds, cfg, collate_fn=pad_collate)
    model = DistributedDataParallel(_model())
    worst = 0.0
    windows = 0
    window_indices = []
    for step in loader:
        logits = model(step.data["input_ids"])
        scaled_loss(step, logits, step.data["labels"]).backward()
        window_indices += step.indices
        if (step.step + 1) % accumulation:
            continue
        every = [None] * world
        dist.all_gather_object(every, window_indices)
        if rank == 0:
            ids = sorted(i for part in every for i in part)
            ref = _reference_grad([ds[i] for i in ids])
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            worst = max(worst, float((got - ref).norm() / ref.norm()))
        model.zero_grad()
        window_indices = []
        windows += 1
    return worst, windows


@pytest.mark.parametrize("world,accumulation", [(1, 1), (2, 1), (3, 1), (2, 3)])
def test_scaled_gradients_equal_global_token_mean(world, accumulation):
    results = run_world(_rank, world, accumulation)
    worst, windows = results[0]
    assert windows > 2
    assert worst <= 1e-12, worst


def test_unscaled_ddp_average_is_not_exact():
    """The check above can fail: without the scale (plain DDP mean of per-rank means) the
    gradient differs from the global token mean on variable-size steps."""
    import torch
    from odb_factory.loss import token_mean_loss
    from odb_factory.synthetic import LengthDataset, pad_collate
    ds = LengthDataset([10, 200])
    ref = _reference_grad([ds[0], ds[1]])
    grads = []
    for i in (0, 1):
        model = _model()
        batch = pad_collate([ds[i]])
        (token_mean_loss(model(batch["input_ids"]), batch["labels"]) / 2).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[0] + grads[1] - ref).norm() / ref.norm()) > 1e-3
