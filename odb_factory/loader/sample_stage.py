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

from ..cost import CostFn, MissingCostKeyError, SampleCost
from .payload import Packed, pack

MAX_CHUNK = 16  # samples per worker fetch (see chunk_size)


def identity(x: Any) -> Any:
    """Null collate: keep the sample as it is (module-level so spawn can pickle it)."""
    return x


class CostedDataset(Dataset):
    """dataset[i] -> (i, sample, cost)."""

    def __init__(self, dataset: Any, cost_fn: CostFn):
        self.dataset = dataset
        self.cost_fn = cost_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Tuple[int, Any, SampleCost]:
        sample = self.dataset[index]
        try:
            cost = self.cost_fn(sample)
        except MissingCostKeyError as exc:
            raise MissingCostKeyError(f"dataset sample {index}: {exc.args[0]}") from None
        # a user cost function may return a plain tuple
        return index, sample, cost if type(cost) is SampleCost else SampleCost(*cost)


class PackedChunks(Dataset):
    """chunks[[i, j, ...]] -> [(i, packed sample, cost), ...]: one sample worker fetch."""

    def __init__(self, costed: CostedDataset):
        self.costed = costed

    def __len__(self) -> int:
        return len(self.costed)

    def __getitem__(self, indices: List[int]) -> List[Tuple[int, Packed, SampleCost]]:
        out = []
        for index in indices:
            index, sample, cost = self.costed[index]
            out.append((index, pack(sample), cost))
        return out


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
        order = iter(self.order)
        while True:
            indices = list(itertools.islice(order, self.chunk))
            if not indices:
                return
            yield indices


def in_thread_samples(dataset: CostedDataset, order: Iterable[int],
                      packed: bool) -> Iterator[Tuple[int, Any, SampleCost]]:
    """num_workers=0: run the per-sample pipeline in the planner thread. `packed`: the
    samples go on to collate workers, so they are packed here, off the training thread."""
    for index in order:
        index, sample, cost = dataset[index]
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
