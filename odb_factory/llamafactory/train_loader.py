"""What HF's training loop iterates with ODB: LLaMA-Factory batches, one ODB epoch per
`iter()`, with the bookkeeping the trainer callback needs (progress, ledger, metrics)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import torch

from ..loader import ODBBatch, ODBDataLoader
from . import state


class LFCollate:
    """LLaMA-Factory's collator, plus: the first label of every row is masked. A shifted
    causal-LM loss never uses it, and masking it makes HF's label count
    (`num_items_in_batch`) equal to the number of tokens the loss averages over."""

    def __init__(self, collator: Callable[[List[Dict[str, Any]]], Dict[str, Any]]):
        self.collator = collator

    def __call__(self, features: List[Dict[str, Any]]) -> Dict[str, Any]:
        batch = self.collator(features)
        batch["labels"][:, 0] = -100
        return batch


class TrainLoader:
    """Iterating it yields the batch dicts of one epoch on this rank; when the epoch is
    over it tells the trainer (`should_epoch_stop`), since HF's loop length is only an
    upper bound with variable-size batches."""

    def __init__(self, loader: ODBDataLoader, control_of: Callable[[], Any],
                 epoch_samples: int):
        self.loader = loader
        self.control_of = control_of
        self.epoch_samples = epoch_samples    # samples one epoch trains over all ranks
        self.pending: List[ODBBatch] = []     # micro-steps since the last optimizer step
        self.epoch_consumed = 0               # samples of the current epoch, all ranks

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.loader.epoch:
            self.epoch_consumed = 0
        self.loader.set_epoch(epoch)

    @property
    def dataset(self):
        return self.loader.dataset

    def steps_upper_bound(self) -> int:
        """Micro-steps one epoch can take at most: every step trains at least one sample
        on some rank, plus the IDLE steps that complete the last accumulation window."""
        ga = self.loader.config.gradient_accumulation_steps
        return ga * (math.ceil(self.epoch_samples / ga) + 1)

    def __iter__(self):
        for step in self.loader:
            batch = step.data
            if step.is_idle:
                batch["labels"] = torch.full_like(batch["labels"], -100)
            self.pending.append(step)
            self.epoch_consumed += step.global_num_samples
            state.progress.consumed += step.global_num_samples
            yield batch
        control = self.control_of()
        if control is not None:
            control.should_epoch_stop = True

    def take_pending(self) -> List[ODBBatch]:
        done, self.pending = self.pending, []
        return done
