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
