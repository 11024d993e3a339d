"""Per-sample stage: the dataset's own pipeline in DataLoader workers, plus its cost.

Workers run with a null collate, so each yields one processed sample; the cost function
runs beside the pipeline, in the worker, on exactly what will be trained.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Tuple

from torch.utils.data import Dataset, Sampler

from ..cost import CostFn, MissingCostKeyError, SampleCost


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
        return index, sample, SampleCost(*cost)


class ViewSampler(Sampler):
    """Yields the indices this rank reads in the current epoch (set before each iter)."""

    def __init__(self) -> None:
        self.order: Iterable[int] = ()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)


def in_thread_samples(dataset: CostedDataset, order: Iterable[int]) -> Iterator[Tuple[int, Any, SampleCost]]:
    """num_workers=0: run the per-sample pipeline in the planner thread."""
    for index in order:
        yield dataset[index]


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
