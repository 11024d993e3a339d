"""The group stage's parts: CollateJob collates a planned step's samples (in a real collate
worker the result crosses back as one blob), and PlanSampler hands the planner's steps over in
order, ends at the epoch's end, and surfaces a planner failure or a planner that stopped."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
from torch.utils.data import DataLoader

from odb_factory.loader.collate_stage import CollateJob, PlanSampler
from odb_factory.loader.payload import pack
from odb_factory.loader.planner_thread import END_OF_EPOCH, PlannerFailure, StepPlan


def _plan(samples, replayed=False, step=0):
    return StepPlan(epoch=0, step=step, round=0, samples=samples, indices=list(range(len(samples))),
                    is_idle=False, label_tokens=0, input_tokens=0, padded_tokens=0, vision_patches=0,
                    audio_frames=0, global_label_tokens=0, global_num_samples=len(samples), replayed=replayed)


def _stack(samples):
    return torch.stack([s["x"] for s in samples])


def test_a_job_collates_unpacked_samples_and_ships_none_back():
    samples = [pack({"x": torch.tensor([1, 2])}), {"x": torch.tensor([3, 4])}]   # packed, or made here
    plan, data = CollateJob(_stack)[_plan(samples)]
    assert torch.equal(data, torch.tensor([[1, 2], [3, 4]]))
    assert plan.samples == []


def test_a_replayed_step_is_not_collated():
    seen = []
    plan = _plan([{"x": torch.ones(1)}], replayed=True)
    out_plan, data = CollateJob(seen.append)[plan]
    assert out_plan is plan and data is None and seen == []


def test_in_a_collate_worker_the_result_crosses_back_whole():
    plans = [_plan([pack({"x": torch.tensor([i, i])})], step=i) for i in range(3)]
    loader = DataLoader(CollateJob(_stack), sampler=plans, batch_size=None, num_workers=1,
                        collate_fn=lambda x: x)
    out = list(loader)
    assert [p.step for p, _ in out] == [0, 1, 2]
    assert all(p.samples == [] for p, _ in out)
    assert [d.tolist() for _, d in out] == [[[0, 0]], [[1, 1]], [[2, 2]]]
    # inline bytes, not torch's shared-memory segment per tensor (what a bare result would take)
    assert not any(d.is_shared() for _, d in out)


def test_the_sampler_yields_nothing_until_attached_and_stops_at_the_epoch_end():
    sampler = PlanSampler()
    assert list(sampler) == []
    source = queue.Queue()
    for item in ("a", "b", END_OF_EPOCH, "next epoch"):
        source.put(item)
    sampler.attach(source, threading.current_thread())
    assert list(sampler) == ["a", "b"]
    sampler.detach()
    assert sampler.source is None and sampler.planner is None and list(sampler) == []


def test_the_sampler_raises_the_planners_exception_itself():
    source = queue.Queue()
    error = ValueError("bad cost for dataset sample 3")
    source.put("a")
    source.put(PlannerFailure(error))
    sampler = PlanSampler()
    sampler.attach(source, threading.current_thread())
    it = iter(sampler)
    assert next(it) == "a"
    with pytest.raises(ValueError) as raised:
        next(it)
    assert raised.value is error


@pytest.mark.timeout(30)   # reported, not waited for forever (the poll notices within a second)
def test_a_planner_that_stopped_without_a_word_is_reported():
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    source = queue.Queue()
    source.put("last")
    sampler = PlanSampler()
    sampler.attach(source, dead)
    it = iter(sampler)
    assert next(it) == "last"        # what it queued before stopping is still handed over
    with pytest.raises(RuntimeError) as raised:
        next(it)
    assert str(raised.value) == "the ODB planner thread stopped without a result"


def test_a_slow_planner_is_waited_for():
    source = queue.Queue()
    sampler = PlanSampler()
    sampler.attach(source, threading.current_thread())       # alive
    timer = threading.Timer(1.5, lambda: (source.put("late"), source.put(END_OF_EPOCH)))
    timer.start()
    try:
        assert list(sampler) == ["late"]                     # waited past the 1 s poll
    finally:
        timer.cancel()
