"""What HF's training loop iterates with ODB: LLaMA-Factory batches, one ODB epoch per
`iter()`, with the bookkeeping the trainer callback needs (progress, ledger, metrics)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import torch

from ..loader import ODBBatch, ODBDataLoader
from . import state
from .padding_free import TOKEN_SAMPLE_KEY, counted_tokens, token_weights


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

    # HF counts no labels here (the sample weights carry the loss normalisation); transformers
    # 4.57's loop reads the inputs directly to count tokens seen (5.x calls
    # _track_num_input_tokens, which the trainer overrides).
    COUNTED = ("input_ids", "attention_mask")

    def __contains__(self, key: str) -> bool:
        return key in self.COUNTED and all(key in counted_tokens(b) for b in self.micro_batches)

    def __getitem__(self, key: str) -> torch.Tensor:
        """All micro-batches' `input_ids` or `attention_mask` (a packed row's: its samples'
        tokens), flattened into one tensor."""
        if key not in self:
            raise KeyError(key)
        return torch.cat([counted_tokens(b)[key].reshape(-1) for b in self.micro_batches])


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
        self.updates_per_epoch = 0            # HF's optimizer steps per epoch (set_initial_training_values)
        self.epoch_shift = 0                  # ODB epoch - HF epoch after a resume (callbacks._restore)

    @property
    def samples_mode(self) -> bool:
        return self.loader.config.step_mode == "samples"

    def set_epoch(self, epoch: int) -> None:
        epoch += self.epoch_shift
        if epoch != self.loader.epoch:
            self.epoch_consumed = 0
        self.loader.set_epoch(epoch)

    @property
    def dataset(self):
        return self.loader.dataset

    def __len__(self) -> int:
        """Samples mode: the epoch's optimizer steps. Groups mode: the bound HF's loop runs to
        (transformers 4.57 reads it as the epoch's length); the epoch ends earlier, through
        `should_epoch_stop`."""
        return self.steps_per_epoch if self.samples_mode else self.steps_upper_bound()

    def steps_upper_bound(self) -> int:
        """Micro-steps one epoch can take at most: every step trains at least one sample
        on some rank, plus the IDLE steps that complete the last accumulation window."""
        ga = self.loader.config.gradient_accumulation_steps
        return ga * (math.ceil(self.epoch_samples / ga) + 1)

    def __iter__(self):
        micro_batches: List[Dict[str, Any]] = []
        for step in self.loader:
            batch = step.data
            # padding-free rows: each token's sample (the trainer drops it before the model)
            token_sample = batch.get(TOKEN_SAMPLE_KEY)
            if step.is_idle:
                batch["labels"] = torch.full_like(batch["labels"], -100)
            self.pending.append(step)
            self.epoch_consumed += step.global_num_samples
            state.progress.consumed += step.global_num_samples
            state.progress.input_tokens += step.input_tokens
            if not self.samples_mode:
                yield batch
                continue
            batch["odb_sample_weights"] = self.loss_weights(step, token_sample)
            micro_batches.append(batch)
            if step.optimizer_step_end:
                yield OptimizerStepBatch(micro_batches)
                micro_batches = []
        control = self.control_of()
        if control is not None:
            control.should_epoch_stop = True

    @staticmethod
    def loss_weights(step: ODBBatch, token_sample) -> torch.Tensor:
        """Samples mode: each sample's loss weight, per row (padded) or per token (padding-free:
        a row holds several samples); zeros for an IDLE step."""
        if token_sample is not None:
            weights = token_weights(step.sample_weights, token_sample)
            return weights * 0.0 if step.is_idle else weights
        rows = step.data["input_ids"].shape[0]
        return torch.tensor(step.sample_weights if not step.is_idle else [0.0] * rows, dtype=torch.float32)

    def take_pending(self) -> List[ODBBatch]:
        done, self.pending = self.pending, []
        return done
