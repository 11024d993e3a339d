"""fp64: ODB-scaled losses under DDP give the gradient of the global per-token mean."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_world


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(97, 8), torch.nn.Linear(8, 97)).double()


def _reference_grad(samples):
    """One process, all of the window's samples: grad of sum(CE) / #supervised tokens, formed
    sample by sample without padding (not with the token_mean_loss under test): token t+1 is
    predicted from token t, so a sample's first label never counts."""
    import torch
    import torch.nn.functional as F
    model = _model()
    total, count = 0.0, 0
    for s in samples:
        logits = model(s["input_ids"][None])[0]
        targets = s["labels"][1:]
        keep = targets != -100
        total = total + F.cross_entropy(logits[:-1][keep], targets[keep], reduction="sum")
        count += int(keep.sum())
    (total / count).backward()
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


@pytest.mark.slow
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


# ------------------------------------------------------------------ in-process oracles
# Logits here are random fp64; the expected losses are summed token by token in Python
# (log-sum-exp minus the target logit), so the denominator is counted independently of
# odb_factory.loss. The first label is supervised, so counting before the shift shows.

def _hand_row_ce(logits, labels, shift=True, ignore_index=-100):
    """[(summed CE, supervised tokens)] per row, token by token."""
    import math
    out = []
    rows, length = labels.shape
    for b in range(rows):
        total, count = 0.0, 0
        for t in range(length - 1 if shift else length):
            target = int(labels[b, t + 1 if shift else t])
            if target == ignore_index:
                continue
            row = [float(x) for x in logits[b, t]]
            top = max(row)
            total += top + math.log(sum(math.exp(x - top) for x in row)) - row[target]
            count += 1
        out.append((total, count))
    return out


def _hand_mean_ce(logits, labels, shift=True, ignore_index=-100):
    rows = _hand_row_ce(logits, labels, shift, ignore_index)
    return sum(t for t, _ in rows), sum(n for _, n in rows)


def _logits_and_labels():
    import torch
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 5, 11, generator=generator, dtype=torch.float64)
    labels = torch.tensor([[3, 5, -100, 7, 2],         # first label supervised
                           [-100, 1, 2, -100, -100]])
    return logits, labels


@pytest.mark.parametrize("shift,expected_count", [(True, 5), (False, 6)])
def test_token_mean_loss_divides_by_the_tokens_the_loss_sees(shift, expected_count):
    from odb_factory.loss import token_mean_loss
    logits, labels = _logits_and_labels()
    total, count = _hand_mean_ce(logits, labels, shift)
    assert count == expected_count       # shifted: 5, 7, 2 and 1, 2; unshifted adds the 3
    got = float(token_mean_loss(logits, labels, shift=shift))
    assert got == pytest.approx(total / count, rel=1e-12)


def test_token_mean_loss_honours_ignore_index():
    from odb_factory.loss import token_mean_loss
    logits, labels = _logits_and_labels()
    labels = labels.masked_fill(labels == 2, -1)   # -1 is ignored now, -100 is not a valid class
    labels = labels.masked_fill(labels == -100, 0)
    total, count = _hand_mean_ce(logits, labels, True, ignore_index=-1)
    assert float(token_mean_loss(logits, labels, ignore_index=-1)) == pytest.approx(total / count, rel=1e-12)


def test_no_supervised_token_gives_zero_not_nan():
    import torch
    from odb_factory.loss import token_mean_loss
    logits = torch.randn(1, 4, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[2, -100, -100, -100]])  # the only supervised label is never predicted
    loss = token_mean_loss(logits, labels)
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.abs().sum().item() == 0.0


def test_scaled_loss_is_the_mean_times_the_step_scale():
    from types import SimpleNamespace
    from odb_factory.loss import scaled_loss
    logits, labels = _logits_and_labels()
    total, count = _hand_mean_ce(logits, labels)
    for scale in (0.0, 0.25, 3.0):
        got = float(scaled_loss(SimpleNamespace(loss_scale=scale), logits, labels))
        assert got == pytest.approx(scale * total / count, rel=1e-12, abs=0.0)
    unshifted, n = _hand_mean_ce(logits, labels, shift=False)
    got = float(scaled_loss(SimpleNamespace(loss_scale=2.0), logits, labels, shift=False))
    assert got == pytest.approx(2.0 * unshifted / n, rel=1e-12)


@pytest.mark.parametrize("shift", [True, False])
def test_weighted_token_sum_weighs_each_rows_summed_loss(shift):
    import torch
    from odb_factory.loss import weighted_token_sum
    logits, labels = _logits_and_labels()
    rows = _hand_row_ce(logits, labels, shift)
    weights = torch.tensor([0.25, 3.0], dtype=torch.float64)
    got = float(weighted_token_sum(logits, labels, weights, shift=shift))
    assert got == pytest.approx(0.25 * rows[0][0] + 3.0 * rows[1][0], rel=1e-12)
    if shift:  # the default
        assert float(weighted_token_sum(logits, labels, weights)) == pytest.approx(got, rel=1e-12)
    masked = labels.masked_fill(labels == 7, -1)
    rows = _hand_row_ce(logits, masked.masked_fill(masked == -100, 0), shift, ignore_index=-1)
    got = float(weighted_token_sum(logits, masked.masked_fill(masked == -100, 0), weights, -1, shift))
    assert got == pytest.approx(0.25 * rows[0][0] + 3.0 * rows[1][0], rel=1e-12)


@pytest.mark.parametrize("shift", [True, False])
def test_weighted_token_sum_per_token_weights_weigh_each_tokens_loss(shift):
    """Weights shaped like the labels (a padding-free row of several samples): a label is
    weighted by its own token's weight; row weights broadcast to tokens give the same sum."""
    import torch
    from odb_factory.loss import weighted_token_sum
    logits, labels = _logits_and_labels()
    row_weights = torch.tensor([0.25, 3.0], dtype=torch.float64)
    per_token = row_weights.unsqueeze(1).expand(labels.shape).clone()
    expected = float(weighted_token_sum(logits, labels, row_weights, shift=shift))
    assert float(weighted_token_sum(logits, labels, per_token, shift=shift)) == pytest.approx(expected, rel=1e-12)
    per_token[0, 0] = 100.0  # the first label: not in a shifted loss
    got = float(weighted_token_sum(logits, labels, per_token, shift=shift))
    assert (got == pytest.approx(expected, rel=1e-12)) == shift
    per_token[0, -1] = 100.0  # the last label (supervised): weighted by its own position's weight
    assert float(weighted_token_sum(logits, labels, per_token, shift=shift)) > got + 1.0
    # fp64 weights never lift a float32 model's loss (and its backward) to fp64
    for weights in (row_weights, per_token):
        assert weighted_token_sum(logits.float(), labels, weights, shift=shift).dtype == torch.float32


@pytest.mark.parametrize("shift", [True, False])
def test_supervised_positions_keep_exactly_the_logits_the_loss_reads(shift):
    """Logits computed at `supervised_positions` only (a model's `logits_to_keep`) give the
    same weighted sum as all logits, for row and per-token weights; every position left out
    has no supervised label, every one kept has one in some row."""
    import torch
    from odb_factory.loss import supervised_positions, weighted_token_sum
    logits, labels = _logits_and_labels()
    positions = supervised_positions(labels, shift=shift)
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100) if shift else labels
    supervised = targets.ne(-100).any(dim=0)
    assert positions.tolist() == supervised.nonzero().squeeze(1).tolist()
    assert positions.tolist() == ([0, 1, 2, 3] if shift else [0, 1, 2, 3, 4])
    row_weights = torch.tensor([0.25, 3.0], dtype=torch.float64)
    per_token = torch.rand(labels.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for weights in (row_weights, per_token):
        expected = float(weighted_token_sum(logits, labels, weights, shift=shift))
        kept = logits[:, positions]
        assert float(weighted_token_sum(kept, labels, weights, shift=shift, positions=positions)) == \
            pytest.approx(expected, rel=1e-12)
    # nothing supervised: one position, whose loss term is zero, keeps the batch in the graph
    nothing = torch.full_like(labels, -100)
    assert supervised_positions(nothing, shift=shift).tolist() == [0]
    kept = logits[:, :1].clone().requires_grad_()
    total = weighted_token_sum(kept, nothing, row_weights, shift=shift, positions=torch.tensor([0]))
    total.backward()
    assert float(total.detach()) == 0.0 and kept.grad is not None


def test_weighted_loss_uses_the_step_weights_and_keeps_idle_steps_in_the_graph():
    from types import SimpleNamespace
    import torch
    from odb_factory.loss import weighted_loss
    logits, labels = _logits_and_labels()
    rows = _hand_row_ce(logits, labels)
    w = [0.1, 1 / 3]  # not float32 numbers: fp64 logits need fp64 weights to stay exact
    step = SimpleNamespace(sample_weights=w, is_idle=False)
    assert float(weighted_loss(step, logits, labels)) == pytest.approx(w[0] * rows[0][0] + w[1] * rows[1][0],
                                                                       rel=1e-13)
    unshifted = _hand_row_ce(logits, labels, shift=False)
    got = float(weighted_loss(step, logits, labels, shift=False))
    assert got == pytest.approx(w[0] * unshifted[0][0] + w[1] * unshifted[1][0], rel=1e-13)
    single = logits.float()
    got = weighted_loss(step, single, labels)
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(w[0] * rows[0][0] + w[1] * rows[1][0], rel=1e-5)
    for idle in (SimpleNamespace(sample_weights=[1.0], is_idle=True),
                 SimpleNamespace(sample_weights=[], is_idle=False)):
        leaf = logits.clone().requires_grad_(True)
        loss = weighted_loss(idle, leaf, labels)
        loss.backward()
        assert loss.item() == 0.0 and leaf.grad is not None and leaf.grad.abs().sum().item() == 0.0


def test_llamafactory_token_sum_loss_denominator():
    """LLaMA-Factory's loss: sum of shifted CE / the window's label tokens (HF passes them as
    num_items_in_batch, an int or a tensor); alone it counts this batch's shifted labels."""
    import torch
    from odb_factory.llamafactory.step_modes import token_sum_loss
    logits, labels = _logits_and_labels()
    total, count = _hand_mean_ce(logits, labels)
    outputs = {"logits": logits}
    assert float(token_sum_loss(outputs, labels)) == pytest.approx(total / count, rel=1e-6)
    assert float(token_sum_loss(outputs, labels, 40)) == pytest.approx(total / 40, rel=1e-6)
    assert float(token_sum_loss(outputs, labels, torch.tensor(40))) == pytest.approx(total / 40, rel=1e-6)
    assert float(token_sum_loss(outputs, labels, 0)) == pytest.approx(total, rel=1e-6)  # clamped to 1
    assert float(token_sum_loss(outputs, labels, torch.tensor(0))) == pytest.approx(total, rel=1e-6)
    assert float(token_sum_loss(outputs, labels, torch.tensor(1))) == pytest.approx(total, rel=1e-6)
    # a model output with a `logits` attribute (not a dict) reads the same
    from types import SimpleNamespace
    assert float(token_sum_loss(SimpleNamespace(logits=logits), labels, 40)) == float(token_sum_loss(outputs, labels, 40))
    # the logits of the supervised positions only (what a training forward computes in groups
    # mode): the same loss, and the same gradient for the logits it kept
    from odb_factory.loss import supervised_positions
    positions = supervised_positions(labels)
    assert 0 < positions.numel() < labels.shape[1]
    full = logits.detach().double().requires_grad_()
    kept = full[:, positions].detach().requires_grad_()
    a, b = token_sum_loss({"logits": full}, labels, 40), token_sum_loss({"logits": kept}, labels, 40, positions)
    a.backward()
    b.backward()
    assert float(b.detach()) == pytest.approx(float(a.detach()), rel=1e-12)
    assert torch.allclose(kept.grad, full.grad[:, positions], rtol=0, atol=1e-15)
    assert float(full.grad[:, [i for i in range(labels.shape[1]) if i not in set(positions.tolist())]].abs().sum()) == 0


def test_world_one_window_scales_match_hand_counts_and_the_global_gradient():
    """World 1, accumulation 3, nothing masked (so every label but the first is supervised):
    each step's label_tokens is sum(len - 1) of its samples, the window's denominator is the
    window's sum, scales add up to 1, and the summed scaled losses' gradient is the gradient
    of the window's token mean formed sample by sample."""
    import torch
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.loss import scaled_loss
    from odb_factory.synthetic import LengthDataset, pad_collate

    lengths = [2, 9, 31, 5, 17, 3, 44, 12, 7, 26, 2, 60, 14, 8]
    ds = LengthDataset(lengths, prompt_fraction=0.0)
    cfg = ODBConfig(token_budget=64, buffer_size=5, gradient_accumulation_steps=3,
                    pad_epoch_to_accumulation=True)
    loader = ODBDataLoader(ds, cfg, collate_fn=pad_collate)
    model = _model()
    window, seen, windows = [], [], 0
    try:
        for step in loader:
            assert step.label_tokens == sum(lengths[i] - 1 for i in step.indices)
            window.append(step)
            if not step.is_idle:
                logits = model(step.data["input_ids"])
                scaled_loss(step, logits, step.data["labels"]).backward()
            if len(window) < 3:
                continue
            ids = [i for s in window for i in s.indices]
            seen += ids
            assert {s.global_label_tokens for s in window} == {sum(lengths[i] - 1 for i in ids)}
            assert sum(s.loss_scale for s in window) == pytest.approx(1.0, rel=1e-12)
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            ref = _reference_grad([ds[i] for i in ids])
            assert float((got - ref).norm() / ref.norm()) <= 1e-12
            model.zero_grad()
            window = []
            windows += 1
    finally:
        loader.close()
    assert window == [] and windows >= 2
    assert sorted(seen) == list(range(len(lengths)))
