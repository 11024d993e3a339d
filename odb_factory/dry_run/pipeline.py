"""The training rows through the run's own per-sample pipeline, in worker processes.

The training split is built as the training path builds it for the recipe's stage
(LLaMA-Factory's dataset loading and format conversion of its data stage, `max_samples` and
`val_size` split), then every row, or a seeded random sample of them, goes through
`LazySupervisedDataset` (template, tokenisation, truncation, vision-token expansion) and the
stage's cost function (`DefaultCost`; a dpo pair's `PairCost`) in torch DataLoader workers.
Only a handful of integers per row come back to the main process.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..cost import CostFn
from ..llamafactory.lazy_dataset import LazySupervisedDataset
from .recipe import Recipe
from .stages import Stage

CHUNK = 32                   # rows per worker hand-over: few messages, a smooth progress bar
UNBOUNDED_CUTOFF = 1 << 30   # a cutoff_len no row reaches: the row's length before truncation
FIELDS = ("tokens", "label_tokens", "patches", "images", "patch_sq", "full_tokens")


@dataclass
class TrainingSet:
    """The run's training split and what its pipeline needs."""
    dataset: LazySupervisedDataset
    converted_rows: int           # rows after conversion, max_samples and the val_size split
    stage: Stage
    cost: CostFn                  # the run's cost of a sample (a dpo pair: both its rows)
    vision_token_ids: Tuple[int, ...]
    spatial_merge_size: int
    model_config: Any


@dataclass
class Measured:
    """What the pipeline measured, one entry per processed row (`positions` into the dataset)."""
    positions: np.ndarray
    values: dict                  # FIELDS -> np.ndarray aligned with `positions`
    failures: List[Tuple[int, str]]   # (position, error) for rows the pipeline stopped on
    seconds: float
    workers: int


def training_set(recipe: Recipe) -> TrainingSet:
    """Tokenizer, processor, template and the lazily processed training split (no model)."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.data.data_utils import split_dataset
    from llamafactory.data.loader import _get_dataset_processor, _get_merged_dataset
    from llamafactory.model import load_tokenizer
    from llamafactory.model.loader import load_config

    model_args, data_args, training_args = recipe.model_args, recipe.data_args, recipe.training_args
    stage = recipe.stage
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    merged = _get_merged_dataset(data_args.dataset, model_args, data_args, training_args, stage.data_stage)
    if merged is None:
        raise ValueError("the recipe names no training dataset (dataset: ...)")
    # The eval split is left out: only the training rows are planned.
    train = split_dataset(merged, None, data_args, seed=training_args.seed)[0]["train"]
    processor = _get_dataset_processor(data_args, stage.data_stage, template, tokenizer_module["tokenizer"],
                                       tokenizer_module["processor"])
    lazy = LazySupervisedDataset(train, processor, stage.data_stage)
    if len(lazy) == 0:
        raise ValueError(f"no valid training rows: every row is malformed for LLaMA-Factory's {stage.name} stage")
    config = load_config(model_args)
    vision_ids = tuple(t for t in (getattr(config, "image_token_id", None),
                                   getattr(config, "video_token_id", None)) if t is not None)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 2)
    cfg = recipe.planning_config()
    cost = stage.cost_fn(dataclasses.replace(cfg, vision_token_ids=vision_ids, spatial_merge_size=merge))
    return TrainingSet(lazy, len(train), stage, cost, vision_ids, merge, config)


class RowCosts(torch.utils.data.Dataset):
    """Dataset position -> the row's measured numbers, computed in the worker process: the
    sample's cost (tokens, label tokens, vision patches), its images (counted in every row it is
    trained as, as its patches are), and its tokens plus those cutoff_len cut off its rows.

    A row the pipeline fails on (a missing image, vision tokens cut by cutoff_len) comes back
    as its error: the run would stop there, and the dry run reports it instead of stopping."""

    def __init__(self, data: TrainingSet):
        self.data = data
        lazy = data.dataset
        self.cutoff = lazy.processor.data_args.cutoff_len
        unbounded = copy.copy(lazy.processor.data_args)
        unbounded.cutoff_len = UNBOUNDED_CUTOFF
        self.unbounded = dataclasses.replace(lazy.processor, data_args=unbounded)

    def __len__(self) -> int:
        return len(self.data.dataset)

    def __getitem__(self, position: int):
        lazy = self.data.dataset
        try:
            sample = lazy[position]
        except Exception as exc:  # noqa: BLE001 - any row error would stop the run: report it
            return position, f"{type(exc).__name__}: {exc}"
        cost = self.data.cost(sample)
        rows = self.data.stage.rows(sample)
        runs = np.concatenate([vision_runs(np.asarray(ids), self.data.vision_token_ids) for ids in rows])
        runs = runs * self.data.spatial_merge_size ** 2
        kept = [len(ids) for ids in rows]
        cut = 0
        if max(kept) >= self.cutoff:  # reached cutoff_len: cut, unless exactly that long
            cut = sum(full - n for full, n in zip(self._untruncated_lengths(position), kept))
        return position, (cost.input_tokens, cost.label_tokens, cost.vision_patches, len(runs),
                          int(np.sum(runs.astype(np.int64) ** 2)), cost.input_tokens + cut)

    def _untruncated_lengths(self, position: int) -> List[int]:
        lazy = self.data.dataset
        row = lazy.converted[lazy.rows[position]]
        out = self.unbounded.preprocess_dataset({k: [v] for k, v in row.items()})
        return [len(ids) for ids in self.data.stage.rows({k: v[0] for k, v in out.items()})]


def vision_runs(ids: np.ndarray, vision_ids: Sequence[int]) -> np.ndarray:
    """Lengths of the runs of vision tokens in `ids`: one run per image (or video), since the
    template puts vision start/end tokens around each."""
    if not len(vision_ids) or not len(ids):
        return np.zeros(0, dtype=np.int64)
    mask = np.isin(ids, list(vision_ids)).astype(np.int8)
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    return np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)


def choose_rows(total: int, rows: Optional[int], seed: int) -> np.ndarray:
    """Every position, or a seeded random sample of `rows` of them (in dataset order)."""
    if rows is None or rows >= total:
        return np.arange(total, dtype=np.int64)
    if rows < 1:
        raise ValueError(f"--rows {rows}: at least one row is needed")
    return np.sort(np.asarray(random.Random(f"odb-plan:{seed}").sample(range(total), rows), dtype=np.int64))


def _keep(batch):
    return batch


def measure(data: TrainingSet, positions: np.ndarray, workers: int, progress: bool = True) -> Measured:
    """Run the pipeline over `positions` in `workers` DataLoader processes (0: this process)."""
    from tqdm import tqdm
    loader = torch.utils.data.DataLoader(
        RowCosts(data), batch_size=CHUNK, sampler=positions.tolist(), num_workers=workers,
        collate_fn=_keep, prefetch_factor=4 if workers else None)
    values = {name: np.zeros(len(positions), dtype=np.int64) for name in FIELDS}
    slot = {int(p): i for i, p in enumerate(positions)}
    failures: List[Tuple[int, str]] = []
    start = time.perf_counter()
    with tqdm(total=len(positions), desc="pipeline", unit="row", file=sys.stderr,
              disable=not progress, mininterval=0.5) as bar:
        for chunk in loader:
            for position, result in chunk:
                if isinstance(result, str):
                    failures.append((position, result))
                    continue
                for name, value in zip(FIELDS, result):
                    values[name][slot[position]] = value
            bar.update(len(chunk))
    failed = {p for p, _ in failures}
    keep = np.asarray([int(p) not in failed for p in positions], dtype=bool)
    return Measured(positions[keep], {k: v[keep] for k, v in values.items()}, sorted(failures),
                    time.perf_counter() - start, workers)
