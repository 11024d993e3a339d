"""step_mode="samples" on real gloo ranks: what each micro-step reports (the optimizer step's
global counts, with or without post-balancing; its padded cost), and what a rank is told when
a peer stops: the exchange and the optimizer step it waited in, counted across a resume."""

from __future__ import annotations

import time

import pytest

from tests.helpers.distributed import run_world
from tests.helpers.stalling import StallsAt

N = 101
BATCH, ACCUMULATION, PAD = 4, 2, 8


def _config(**overrides):
    from odb_factory import ODBConfig
    return ODBConfig(**{"step_mode": "samples", "token_budget": 256, "standard_batch_size": BATCH,
                        "gradient_accumulation_steps": ACCUMULATION, "pad_to_multiple_of": PAD,
                        "balance_mode": "lpt", **overrides})


def _dataset():
    from odb_factory.synthetic import LengthDataset, long_tail_lengths
    return LengthDataset(long_tail_lengths(N, cv=1.0, mean=40, seed=7, maximum=300))


def _micro_steps(rank, world, balance):
    from odb_factory import ODBDataLoader
    from odb_factory.synthetic import pad_collate
    loader = ODBDataLoader(_dataset(), _config(balance=balance), collate_fn=pad_collate)
    out = []
    for step in loader:
        labels, rows = step.data["labels"], step.data["input_ids"].shape
        out.append({"indices": step.indices, "idle": step.is_idle, "end": step.optimizer_step_end,
                    "label_tokens": step.label_tokens, "global_label_tokens": step.global_label_tokens,
                    "global_num_samples": step.global_num_samples, "padded": step.padded_tokens,
                    "data_label_tokens": int((labels[:, 1:] != -100).sum()),
                    "data_padded": rows[0] * (-(-rows[1] // PAD) * PAD),
                    "balanced": "balance_max_over_lb" in step.metrics})
    loader.close()
    return out


def _optimizer_steps(micro_steps):
    steps, current = [], []
    for micro in micro_steps:
        current.append(micro)
        if micro["end"]:
            steps.append(current)
            current = []
    assert current == [], "the epoch ends with an optimizer step"
    return steps


@pytest.mark.parametrize("balance", [False, True], ids=["alone", "post-balanced"])
def test_every_micro_step_carries_its_optimizer_steps_global_counts(balance):
    from odb_factory.planning.optimizer_steps import fixed_batch_steps
    ranks = run_world(_micro_steps, 2, balance, timeout=180)
    per_rank = [_optimizer_steps(r) for r in ranks]
    fixed = [fixed_batch_steps(N, 2, r, BATCH, ACCUMULATION, _config().seed, 0) for r in range(2)]
    assert [len(steps) for steps in per_rank] == [len(fixed[0])] * 2
    for k in range(len(fixed[0])):   # each optimizer step trains the fixed-batch step's samples
        assert sorted(i for steps in per_rank for m in steps[k] for i in m["indices"]) == sorted(
            i for r in range(2) for i in fixed[r][k].indices)
    for k in range(len(per_rank[0])):
        step = [s[k] for s in per_rank]
        tokens = sum(m["label_tokens"] for micro in step for m in micro)
        samples = sum(len(m["indices"]) for micro in step for m in micro)
        for micro in step:
            # every micro-step of the step: the whole step's label tokens (the loss denominator);
            # its sample count rides on the first micro-step only
            assert [m["global_label_tokens"] for m in micro] == [tokens] * len(micro)
            assert [m["global_num_samples"] for m in micro] == [samples] + [0] * (len(micro) - 1)
            # so do the step's figures (post-balancing's, when it runs)
            assert [m["balanced"] for m in micro] == [balance] + [False] * (len(micro) - 1)
            for m in micro:
                if not m["idle"]:
                    assert m["label_tokens"] == m["data_label_tokens"]
                    assert m["padded"] == m["data_padded"]


def _hang_in_step(rank, world, hang_rank, hang_step, resume_after):
    """Train `resume_after` optimizer steps, save, resume in a fresh loader whose dataset hangs
    (on rank `hang_rank`) at the first sample of optimizer step `hang_step`; return the error.
    (Samples load ahead in chunks: a rank stalls at the first step whose chunk holds the sample.)"""
    from odb_factory import ODBDataLoader
    from odb_factory.planning.optimizer_steps import fixed_batch_steps
    from odb_factory.synthetic import pad_collate
    config = _config(sync_timeout_s=6.0)   # short for the resumed run only: it is the wait measured
    first = ODBDataLoader(_dataset(), _config(sync_timeout_s=120.0), collate_fn=pad_collate)
    done = 0
    for step in first:
        done += step.optimizer_step_end
        if done == resume_after:
            break
    state = first.state_dict()
    first.close()

    stuck = fixed_batch_steps(N, world, hang_rank, BATCH, ACCUMULATION, config.seed, 0)[hang_step].indices[0]
    dataset = StallsAt(_dataset(), stuck if rank == hang_rank else None)
    resumed = ODBDataLoader(dataset, config, collate_fn=pad_collate)
    resumed.load_state_dict(state)
    try:
        for _ in resumed:
            pass
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        resumed.close()
    return None


def test_a_silent_peer_is_named_with_the_optimizer_step_it_never_reached():
    # the first step after the resume: steps are counted from the epoch's start, not the resume
    waiting, _ = run_world(_hang_in_step, 2, 1, 2, 2, timeout=180)
    assert waiting is not None
    assert "ODB alignment exchange 'optimizer step'" in waiting and "(epoch 0, round 2)" in waiting, waiting
    assert "Rank(s) [1] never entered this exchange" in waiting, waiting


def _leave_after(rank, world, leave_after):
    from odb_factory import ODBDataLoader
    from odb_factory.synthetic import pad_collate
    loader = ODBDataLoader(_dataset(), _config(sync_timeout_s=60.0), collate_fn=pad_collate)
    start, done = time.monotonic(), 0
    try:
        for step in loader:
            done += step.optimizer_step_end
            if rank == 1 and done == leave_after:
                break
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    finally:
        loader.close()
    return None, time.monotonic() - start


def test_a_peer_that_stops_iterating_is_reported_at_once():
    (text, seconds), (left, _) = run_world(_leave_after, 2, 3, timeout=180)
    assert left is None
    assert text is not None and "rank 1 stopped iterating epoch 0" in text, text
    assert seconds < 30, f"rank 0 learned after {seconds:.0f}s, not from rank 1's notice"


def _leave_in_the_last_step(rank, world):
    """Planning in the training thread (no workers): rank 1 leaves one micro-step into the
    epoch's last optimizer step, after the last exchange; rank 0 trains it to the end."""
    from odb_factory import ODBDataLoader
    from odb_factory.synthetic import pad_collate
    loader = ODBDataLoader(_dataset(), _config(sync_timeout_s=20.0), collate_fn=pad_collate, num_workers=0,
                           num_collate_workers=0)
    last = len(loader._fixed_batch_steps(0)) - 1
    start, ends = time.monotonic(), 0
    for step in loader:
        if rank == 1 and ends == last:
            break
        ends += step.optimizer_step_end
    loader.close()
    return ends, time.monotonic() - start


def test_leaving_after_the_last_exchange_waits_for_no_peer():
    """No exchange follows the last step's: a rank leaving then has no peer to tell, and
    must not wait for one (sync_timeout_s) to take its notice."""
    (zero, _), (one, seconds) = run_world(_leave_in_the_last_step, 2, timeout=180)
    assert zero == one + 1
    assert seconds < 15, f"rank 1 left after {seconds:.0f}s"
