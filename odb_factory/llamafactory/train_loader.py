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


class OptimizerStepBatch:
    """Samples mode: what HF's loop receives as one batch, the micro-batches of one optimizer
    step (HF accumulates over 1; `ODBTrainerMixin.training_step` runs them)."""

    def __init__(self, micro_batches: List[Dict[str, Any]]):
        self.micro_batches = micro_batches

    def __contains__(self, key: str) -> bool:
        return False  # HF counts no labels here: the sample weights carry the loss normalisation


class TrainLoader:
    """Iterating it yields the batches of one epoch on this rank (groups mode: one per
    micro-step; samples mode: one OptimizerStepBatch per optimizer step); when the epoch is
    over it tells the trainer (`should_epoch_stop`), since in groups mode HF's loop length is
    only an upper bound."""

    def __init__(self, loader: ODBDataLoader, control_of: Callable[[], Any],
                 epoch_samples: int, steps_per_epoch: int = 0):
        self.loader = loader
        self.control_of = control_of
        self.epoch_samples = epoch_samples    # samples one epoch trains over all ranks
        self.steps_per_epoch = steps_per_epoch  # samples mode: optimizer steps of an epoch
        self.pending: List[ODBBatch] = []     # micro-steps since the last optimizer step
        self.epoch_consumed = 0               # samples of the current epoch, all ranks

    @property
    def samples_mode(self) -> bool:
        return self.loader.config.step_mode == "samples"

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.loader.epoch:
            self.epoch_consumed = 0
        self.loader.set_epoch(epoch)

    @property
    def dataset(self):
        return self.loader.dataset

    def __len__(self) -> int:
        if not self.samples_mode:
            raise TypeError("groups mode has no fixed length; see steps_upper_bound()")
        return self.steps_per_epoch

    def steps_upper_bound(self) -> int:
        """Micro-steps one epoch can take at most: every step trains at least one sample
        on some rank, plus the IDLE steps that complete the last accumulation window."""
        ga = self.loader.config.gradient_accumulation_steps
        return ga * (math.ceil(self.epoch_samples / ga) + 1)

    def __iter__(self):
        micro_batches: List[Dict[str, Any]] = []
        for step in self.loader:
            batch = step.data
            if step.is_idle:
                batch["labels"] = torch.full_like(batch["labels"], -100)
            self.pending.append(step)
            self.epoch_consumed += step.global_num_samples
            state.progress.consumed += step.global_num_samples
            state.progress.input_tokens += step.input_tokens
            if not self.samples_mode:
                yield batch
                continue
            rows = batch["input_ids"].shape[0]
            weights = step.sample_weights if not step.is_idle else [0.0] * rows
            batch["odb_sample_weights"] = torch.tensor(weights, dtype=torch.float32)
            micro_batches.append(batch)
            if step.optimizer_step_end:
                yield OptimizerStepBatch(micro_batches)
                micro_batches = []
        control = self.control_of()
        if control is not None:
            control.should_epoch_stop = True

    def take_pending(self) -> List[ODBBatch]:
        done, self.pending = self.pending, []
        return done
