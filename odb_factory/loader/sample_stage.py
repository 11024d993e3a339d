"""Per-sample stage: the dataset's own pipeline in DataLoader workers, plus its cost.

Each worker fetch is a chunk of the view (null collate): the worker runs the pipeline and
the cost function on each of its samples, on exactly what will be trained, and hands the
chunk over at once, every sample packed into one bytes blob (payload.py). One fetch per
chunk and no shared-memory segment per tensor is what keeps the stage as fast as a plain
DataLoader's batches.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, List, Tuple

from torch.utils.data import Dataset, Sampler

from ..cost import CostFn, MissingCostKeyError, SampleCost, checked_cost
from .payload import Packed, pack

MAX_CHUNK = 16  # samples per worker fetch (see chunk_size)
IN_THREAD_CHUNK = 64  # samples per fetch with no workers: DefaultCost.many's fixed cost amortised


def identity(x: Any) -> Any:
    """Null collate: keep the sample as it is (module-level so spawn can pickle it)."""
    return x


class CostedDataset:
    """fetch([i, j, ...]) -> [(i, sample, cost), ...]: the dataset's samples with their costs."""

    def __init__(self, dataset: Any, cost_fn: CostFn):
        self.dataset = dataset
        self.cost_fn = cost_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def fetch(self, indices: List[int]) -> List[Tuple[int, Any, SampleCost]]:
        """[(i, sample, cost)] for a chunk of indices; a cost function with a `many` method
        (DefaultCost) costs the whole chunk in one call."""
        samples = [self.dataset[index] for index in indices]
        many = getattr(self.cost_fn, "many", None)
        try:
            costs = many(samples) if many is not None else None
        except MissingCostKeyError:
            costs = None  # measured one by one below, so the error names the sample
        if costs is None:
            costs = [self._cost(index, sample) for index, sample in zip(indices, samples)]
        return [(index, sample, checked_cost(cost, index)) for index, sample, cost in zip(indices, samples, costs)]

    def _cost(self, index: int, sample: Any) -> SampleCost:
        try:
            return self.cost_fn(sample)
        except MissingCostKeyError as exc:
            raise MissingCostKeyError(f"dataset sample {index}: {exc.args[0]}") from None


class PackedChunks(Dataset):
    """chunks[[i, j, ...]] -> [(i, packed sample, cost), ...]: one sample worker fetch."""

    def __init__(self, costed: CostedDataset):
        self.costed = costed

    def __len__(self) -> int:
        return len(self.costed)

    def __getitem__(self, indices: List[int]) -> List[Tuple[int, Packed, SampleCost]]:
        return [(index, pack(sample), cost) for index, sample, cost in self.costed.fetch(indices)]


def chunk_size(buffer_size: int, workers: int) -> int:
    """Samples per worker fetch: enough to amortise a fetch's fixed cost, few enough that
    every worker holds a share of the planner's first window."""
    return max(1, min(MAX_CHUNK, buffer_size // (2 * max(1, workers))))


class ViewSampler(Sampler):
    """Yields the indices this rank reads in the current epoch (set before each iter), in
    chunks of `chunk` consecutive indices; the order may be endless (non-join)."""

    def __init__(self, chunk: int = 1) -> None:
        self.order: Iterable[int] = ()
        self.chunk = chunk

    def __iter__(self) -> Iterator[List[int]]:
        return self.chunks(self.order, self.chunk)

    @staticmethod
    def chunks(order: Iterable[int], size: int) -> Iterator[List[int]]:
        order = iter(order)
        while True:
            indices = list(itertools.islice(order, size))
            if not indices:
                return
            yield indices


def in_thread_samples(dataset: CostedDataset, order: Iterable[int],
                      packed: bool) -> Iterator[Tuple[int, Any, SampleCost]]:
    """num_workers=0: run the per-sample pipeline in this process, a chunk of samples at a
    time. `packed`: the samples go on to collate workers, so they are packed here, off the
    training thread."""
    for indices in ViewSampler.chunks(order, IN_THREAD_CHUNK):
        for index, sample, cost in dataset.fetch(indices):
            yield index, (pack(sample) if packed else sample), cost


def worker_samples(loader: Any, rank: int) -> Iterator[Tuple[int, Packed, SampleCost]]:
    """The sample workers' chunks, one sample at a time, in the view's order."""
    for chunk in named_worker_deaths(loader, "sample", rank):
        yield from chunk


def named_worker_deaths(loader: Any, role: str, rank: int) -> Iterator[Any]:
    """Iterate `loader`; a worker process that died is reported as such ("sample worker
    pid N on rank r was killed by signal 9"), not as a bare connection error."""
    iterator = iter(loader)
    try:
        yield from iterator
    except (RuntimeError, ConnectionError, EOFError) as exc:
        dead = [w for w in getattr(iterator, "_workers", []) if w.exitcode not in (None, 0)]
        if not dead:
            raise
        how = ", ".join(f"pid {w.pid} " + (f"was killed by signal {-w.exitcode}" if w.exitcode < 0
                                          else f"exited with code {w.exitcode}") for w in dead)
        raise RuntimeError(f"{role} worker {how} on rank {rank} (a crash or the out-of-memory "
                           f"killer; the dataset pipeline may need less memory per worker)") from exc
