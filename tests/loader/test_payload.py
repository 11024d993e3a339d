"""Packed samples and Compact results come back equal to what was sent: every dtype and shape,
non-contiguous and empty tensors, writable; what the inline path cannot carry is pickled as it
is; a large result tensor takes torch's shared memory instead of the blob."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odb_factory.loader import payload
from odb_factory.loader.payload import SHARED_ABOVE, Compact, Packed, pack, unpack

DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
          torch.uint8, torch.bool, torch.bfloat16, torch.complex64]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert type(b) is type(a) and b.dtype == a.dtype and b.shape == a.shape
        assert b.requires_grad == a.requires_grad
        assert torch.equal(b.detach(), a.detach())
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(b) is type(a) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _through_a_queue(obj):
    """What a worker queue does: ForkingPickler out, pickle.loads in."""
    return pickle.loads(bytes(ForkingPickler.dumps(obj)))


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    t = (torch.arange(int(np.prod(shape)), dtype=torch.float64) - 3).reshape(shape).to(dtype)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)            # not contiguous
    if draw(st.booleans()) and t.dim() >= 1 and t.shape[0] > 1:
        t = t[::2]                       # strided
    return t


samples = st.recursive(tensors() | st.integers() | st.text(max_size=3) | st.none(),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner,
                                                                                  max_size=3),
                       max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(sample=samples)
def test_a_packed_sample_unpacks_equal_after_crossing_a_queue(sample):
    packed = _through_a_queue(pack(sample))
    assert type(packed) is Packed
    _same(sample, unpack(packed))


@settings(max_examples=150, deadline=None)
@given(result=samples)
def test_a_compact_result_arrives_as_the_object_it_wraps(result):
    _same(result, _through_a_queue(Compact(result)))


def test_unpacked_tensors_are_writable_and_keep_their_shape():
    sample = {"input_ids": torch.arange(12).reshape(3, 4), "empty": torch.zeros(0, 5), "one": torch.ones(3)}
    out = unpack(_through_a_queue(pack(sample)))
    assert out["empty"].shape == (0, 5) and out["one"].shape == (3,)
    out["input_ids"][0, 0] = 99                 # a read-only buffer would warn or raise here
    assert out["input_ids"][0, 0] == 99 and sample["input_ids"][0, 0] == 0


def test_what_is_not_a_plain_cpu_tensor_is_pickled_as_it_is():
    leaf = torch.ones(3, requires_grad=True)
    param = torch.nn.Parameter(torch.ones(2))
    for tensor in (leaf, param, torch.ones(2, dtype=torch.bfloat16), torch.ones(4).to_sparse()):
        assert payload._inline(tensor, None) is None
        back = unpack(_through_a_queue(pack(tensor)))
        assert type(back) is type(tensor) and back.requires_grad == tensor.requires_grad
        assert torch.equal(back.detach().to_dense(), tensor.detach().to_dense())


def test_anything_but_a_packed_sample_is_returned_as_it_is():
    filler = {"input_ids": [1, 2]}
    assert unpack(filler) is filler


def test_only_a_result_tensor_above_the_limit_leaves_the_blob():
    small = torch.ones(16)
    large = torch.ones(SHARED_ABOVE // 4 + 1)             # float32: one element over the limit
    assert payload._inline(small, SHARED_ABOVE) is not None
    assert payload._inline(large, SHARED_ABOVE) is None
    assert payload._inline(torch.ones(SHARED_ABOVE // 4), SHARED_ABOVE) is not None   # at the limit: inline
    blob = ForkingPickler.dumps(Compact({"small": small, "large": large}))
    assert len(blob) < SHARED_ABOVE        # the large tensor's bytes went to shared memory
    back = pickle.loads(bytes(blob))
    assert torch.equal(back["large"], large) and torch.equal(back["small"], small)
    assert back["large"].is_shared() and not back["small"].is_shared()
    # a packed sample carries every tensor inline, whatever its size
    assert len(pack({"large": large}).blob) > SHARED_ABOVE


def test_a_packed_sample_pickles_as_its_bytes_only():
    packed = pack({"input_ids": torch.arange(5)})
    assert Packed.__reduce__(packed) == (Packed, (packed.blob,))
    with pytest.raises(AttributeError):
        packed.other = 1                  # __slots__: nothing else rides along
