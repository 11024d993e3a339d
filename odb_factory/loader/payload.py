"""Compact payloads: a processed sample, or a collated step, as one bytes blob.

torch's worker queues move every CPU tensor through its own shared-memory segment, whose
file descriptor is handed over on a socket: that costs milliseconds per tensor, far more
than copying the few kilobytes of a token sample. A blob carries CPU tensors' bytes inline
instead, so a tensor costs a memory copy, not a segment and a socket round trip:

* `pack(sample)` -> `Packed`: a sample crosses from its sample worker, through planning
  (which reads only its cost), to whoever collates it as plain bytes, and is unpickled once,
  there (`unpack`). Every tensor is inline: a packed sample may wait, or be dropped with
  its epoch, unread, so it must hold nothing that a reader has to collect.
* `Compact(result)`: a collated step crosses back to the trainer, which unpickles it on
  arrival; tensors above SHARED_ABOVE still take torch's shared memory, which is cheaper
  for them.

What the inline path does not cover (tensor subclasses, requires_grad, CUDA, sparse, dtypes
numpy lacks) is pickled as before: slower, still correct.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import torch

SHARED_ABOVE = 8 << 20  # bytes: a larger tensor of a collated step goes through shared memory


def _tensor(buffer: bytearray, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """Rebuild a tensor over its unpickled (writable) buffer, without another copy."""
    if not buffer:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


def _inline(tensor: torch.Tensor, limit: Optional[int]) -> Optional[tuple]:
    """The reduction that carries a plain CPU tensor's bytes in the pickle, or None when
    the tensor is not one (or is larger than `limit`)."""
    try:
        array = tensor.numpy()  # raises for CUDA, autograd, sparse, quantized, bfloat16 ...
    except (TypeError, RuntimeError):
        return None
    if limit is not None and array.nbytes > limit:
        return None
    if not array.flags.c_contiguous:
        array = array.copy()
    # a writable buffer pickles in-band as a bytearray: the rebuilt tensor is writable too
    return _tensor, (pickle.PickleBuffer(array), tensor.dtype, array.shape)


def _reduce_sample_tensor(tensor: torch.Tensor) -> tuple:
    # torch's own reduction does not read the protocol
    return _inline(tensor, None) or tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # pragma: no mutate, see above


class _SamplePickler(pickle.Pickler):
    # exact type: tensor subclasses keep their own reduction
    dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_sample_tensor}


class _ResultPickler(ForkingPickler):  # torch registers its shared-memory reductions here
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor:
            return NotImplemented
        return _inline(obj, SHARED_ABOVE) or NotImplemented


def _dumps(obj: Any, pickler: type) -> bytes:
    buffer = io.BytesIO()
    pickler(buffer, 5).dump(obj)
    return buffer.getvalue()


class Packed:
    """One packed sample; pickling a Packed copies its bytes and nothing else."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes):
        self.blob = blob

    def __reduce__(self):
        return Packed, (self.blob,)


def pack(sample: Any) -> Packed:
    return Packed(_dumps(sample, _SamplePickler))


def unpack(payload: Any) -> Any:
    """The sample a Packed holds; anything else is returned as it is (samples produced in
    this process, fillers)."""
    return pickle.loads(payload.blob) if type(payload) is Packed else payload


class Compact:
    """A result that crosses a worker queue once and is read on arrival: it pickles as one
    blob and unpickles straight back to the object it wraps."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __reduce__(self):
        return pickle.loads, (_dumps(self.obj, _ResultPickler),)
