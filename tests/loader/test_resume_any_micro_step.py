"""A state saved after any micro-step resumes exactly, in every mode: the resumed run's steps
are the uninterrupted run's steps from that point (same step numbers, samples, loss weights,
IDLE steps), on every rank, so nothing is trained twice and nothing lost. Save points are
drawn at random (seeded) across the epoch, mid-accumulation ones included."""

from __future__ import annotations

import random

import pytest

from tests.helpers.distributed import run_world

N = 90
MODES = {
    "join": dict(join=True),
    "non-join": dict(join=False),
    "groups, padding-free": dict(join=True, cost_mode="packed", balance_mode="lpt"),
    "samples": dict(step_mode="samples", loss_scaling="micro_mean", standard_batch_size=3),
    "samples, padding-free, balanced": dict(step_mode="samples", loss_scaling="exact", standard_batch_size=3,
                                            cost_mode="packed", balance=True, balance_mode="lpt"),
}


def _loader(mode):
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate
    dataset = LengthDataset(long_tail_lengths(N, cv=1.0, mean=40, seed=11, maximum=300))
    config = ODBConfig(**{"token_budget": 256, "buffer_size": 10, "gradient_accumulation_steps": 3, "seed": 4,
                          "pad_epoch_to_accumulation": True, "sync_timeout_s": 60, **MODES[mode]})
    return ODBDataLoader(dataset, config, collate_fn=pad_collate)


def _record(step):
    return (step.step, tuple(step.indices), tuple(round(w, 12) for w in step.sample_weights), step.is_idle)


def _train_part(mode, state, records, stop=None):
    """Train from `state` (None: the epoch's start), appending to `records` until it holds
    `stop` steps (None: to the epoch's end); returns the state saved there."""
    loader = _loader(mode)
    if state is not None:
        loader.load_state_dict(state)
    for step in loader:
        records.append(_record(step))
        if len(records) == stop:
            break
    state = loader.state_dict()
    loader.close()
    return state


def _save_points_resume(rank, world, mode, points):
    full = []
    _train_part(mode, None, full)
    results = []
    for point in points:
        head, rest = [], []
        _train_part(mode, _train_part(mode, None, head, point), rest)
        results.append((point, head, rest))
    return full, results


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_a_state_saved_after_any_micro_step_resumes_exactly(mode):
    points = sorted(random.Random(mode).sample(range(1, 25), 4))
    ranks = run_world(_save_points_resume, 2, mode, points)
    for number, point in enumerate(points):
        for full, results in ranks:
            _, head, rest = results[number]
            assert head == full[:point], (mode, point)
            assert rest == full[point:], (mode, point, [s[0] for s in rest[:3]], [s[0] for s in full[point:][:3]])
        # (and so the ledger: join and samples mode train every sample once, non-join the quota)
        resumed = [i for full, results in ranks for s in results[number][1] + results[number][2] for i in s[1]]
        if MODES[mode].get("join", True) or mode.startswith("samples"):
            assert sorted(resumed) == sorted(range(N)), (mode, point)
        else:
            assert len(resumed) == N, (mode, point)


def _resume_twice_in_one_optimizer_step(rank, world, mode):
    """Save two micro-steps into an optimizer step of three or more, resume, train one more
    micro-step, save again (the resumed loader's position counts the micro-steps it skipped),
    resume again: the rest is the uninterrupted run's."""
    loader = _loader(mode)
    full = [(_record(s), s.optimizer_step_end) for s in loader]
    loader.close()
    point = 2 + next(i for i in range(len(full) - 2)
                     if (i == 0 or full[i - 1][1]) and not full[i][1] and not full[i + 1][1])
    state, trained = None, []
    for stop in (point, point + 1, None):
        state = _train_part(mode, state, trained, stop)
    return [r for r, _ in full], trained, point


@pytest.mark.parametrize("mode", ["samples", "samples, padding-free, balanced"])
def test_a_resumed_run_saved_again_in_the_same_optimizer_step_resumes_exactly(mode):
    for full, trained, point in run_world(_resume_twice_in_one_optimizer_step, 2, mode, timeout=180):
        assert trained == full, (mode, point)
