"""Token datasets with chosen length distributions, for demos, tests and benchmarks.

`LengthDataset` turns a list of lengths into processed samples of the shape the engine
expects (`input_ids`, `labels` with the prompt masked, and the sample's index, so a
collated batch can be checked against the planner's ledger).
"""

from __future__ import annotations

import math
import random
from typing import Dict, List, Sequence

import torch


def long_tail_lengths(num_samples: int, cv: float, mean: float = 512.0, seed: int = 0,
                      minimum: int = 8, maximum: int = 16384) -> List[int]:
    """Lognormal lengths with the given coefficient of variation (std/mean), clipped."""
    sigma = math.sqrt(math.log(1.0 + cv * cv))
    mu = math.log(mean) - sigma * sigma / 2
    rng = random.Random(seed)
    return [min(maximum, max(minimum, int(rng.lognormvariate(mu, sigma)))) for _ in range(num_samples)]


class LengthDataset(torch.utils.data.Dataset):
    def __init__(self, lengths: Sequence[int], vocab_size: int = 97, prompt_fraction: float = 0.3,
                 seed: int = 0):
        self.lengths = list(lengths)
        self.vocab_size = vocab_size
        self.prompt_fraction = prompt_fraction
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        length = self.lengths[index]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        ids = torch.randint(1, self.vocab_size, (length,), generator=generator)
        labels = ids.clone()
        labels[: int(length * self.prompt_fraction)] = -100
        return {"input_ids": ids, "labels": labels, "index": torch.tensor(index)}


def pad_collate(samples: List[Dict[str, torch.Tensor]], pad_id: int = 0) -> Dict[str, torch.Tensor]:
    """Right-pad a group to its longest sample."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n] = s["input_ids"]
        labels[row, :n] = s["labels"]
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "index": torch.stack([s["index"] for s in samples])}
