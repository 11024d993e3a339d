"""The per-sample stage's pure parts: how a rank's view is cut into worker fetches, and what a
fetch returns (each sample with its checked cost, packed when collate workers follow)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from odb_factory.cost import DefaultCost, MissingCostKeyError, SampleCost
from odb_factory.loader.payload import Packed, unpack
from odb_factory.loader.sample_stage import (IN_THREAD_CHUNK, MAX_CHUNK, CostedDataset, PackedChunks,
                                             ViewSampler, chunk_size, identity, in_thread_samples)


@given(buffer=st.integers(0, 500), workers=st.integers(0, 12))
def test_a_fetch_is_between_one_sample_and_max_chunk_and_shares_the_first_window(buffer, workers):
    size = chunk_size(buffer, workers)
    assert 1 <= size <= MAX_CHUNK
    assert size == 1 or 2 * max(1, workers) * size <= buffer    # every worker gets a fetch of the window


def test_chunk_size_examples():
    assert chunk_size(64, 2) == 16      # 64 // 4 = 16: at the cap
    assert chunk_size(64, 4) == 8
    assert chunk_size(20, 2) == 5
    assert chunk_size(20, 0) == 10      # no workers counts as one
    assert chunk_size(1, 8) == 1
    assert chunk_size(10**6, 1) == MAX_CHUNK


@given(n=st.integers(0, 60), size=st.integers(1, 9))
def test_chunks_cover_the_order_in_consecutive_pieces(n, size):
    pieces = list(ViewSampler.chunks(range(n), size))
    assert [i for piece in pieces for i in piece] == list(range(n))
    assert all(len(piece) == size for piece in pieces[:-1])
    assert not pieces or 1 <= len(pieces[-1]) <= size


def test_the_sampler_reads_its_current_order_each_time_which_may_be_endless():
    single = ViewSampler()
    single.order = range(2)
    assert list(single) == [[0], [1]]                          # one index a fetch by default
    sampler = ViewSampler(chunk=3)
    assert list(sampler) == []
    sampler.order = range(7)
    assert list(sampler) == [[0, 1, 2], [3, 4, 5], [6]]
    sampler.order = iter(lambda: 1, None)                      # endless (non-join views)
    first = iter(sampler)
    assert [next(first) for _ in range(2)] == [[1, 1, 1], [1, 1, 1]]


ROWS = [{"input_ids": torch.arange(n), "labels": torch.arange(n)} for n in (3, 7, 1, 5)]


def test_a_fetch_returns_each_index_with_its_sample_and_cost():
    costed = CostedDataset(ROWS, DefaultCost())
    assert len(costed) == 4
    out = costed.fetch([2, 0])
    assert [i for i, _, _ in out] == [2, 0]
    assert out[0][1] is ROWS[2] and out[1][1] is ROWS[0]
    assert [c.input_tokens for _, _, c in out] == [1, 3] and all(type(c) is SampleCost for _, _, c in out)


def test_a_cost_function_with_many_costs_a_fetch_in_one_call():
    calls = []

    class Batched:
        def __call__(self, sample):
            calls.append("one")
            return SampleCost(len(sample["input_ids"]), 0)

        def many(self, samples):
            calls.append("many")
            return [SampleCost(len(s["input_ids"]), 1) for s in samples]
    out = CostedDataset(ROWS, Batched()).fetch([0, 1, 3])
    assert calls == ["many"] and [c.label_tokens for _, _, c in out] == [1, 1, 1]
    calls.clear()
    assert CostedDataset(ROWS, Batched().__call__).fetch([2])[0][2].input_tokens == 1   # no `many`
    assert calls == ["one"]


def test_a_missing_key_names_the_dataset_index():
    rows = {5: {"input_ids": [1, 2]}, 6: {"text": "no ids"}}       # keyed by dataset index
    with pytest.raises(MissingCostKeyError, match="dataset sample 6: "):
        CostedDataset(rows, DefaultCost()).fetch([5, 6])


def test_packed_chunks_pack_every_sample():
    chunks = PackedChunks(CostedDataset(ROWS, DefaultCost()))
    assert len(chunks) == 4
    out = chunks[[1, 3]]
    assert [i for i, _, _ in out] == [1, 3] and all(type(p) is Packed for _, p, _ in out)
    assert torch.equal(unpack(out[0][1])["input_ids"], ROWS[1]["input_ids"])
    assert [c.input_tokens for _, _, c in out] == [7, 5]


@pytest.mark.parametrize("packed", [False, True])
def test_in_thread_samples_run_the_pipeline_in_order(packed):
    rows = [{"input_ids": list(range(1 + i % 5))} for i in range(IN_THREAD_CHUNK + 10)]
    calls = []

    class Counting(list):
        def __getitem__(self, i):
            calls.append(i)
            return super().__getitem__(i)
    class CountingFetches(CostedDataset):
        def fetch(self, indices):
            fetches.append(len(indices))
            return super().fetch(indices)
    fetches = []
    order = list(reversed(range(len(rows))))
    out = list(in_thread_samples(CountingFetches(Counting(rows), DefaultCost()), iter(order), packed))
    assert [i for i, _, _ in out] == order == calls
    assert fetches == [IN_THREAD_CHUNK, 10]
    assert all((type(s) is Packed) == packed for _, s, _ in out)
    assert [unpack(s) for _, s, _ in out] == [rows[i] for i in order]
    assert [c.input_tokens for _, _, c in out] == [len(rows[i]["input_ids"]) for i in order]


def test_identity_keeps_the_sample():
    sample = object()
    assert identity(sample) is sample
