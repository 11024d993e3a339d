"""What HF's training loop iterates with ODB: LLaMA-Factory batches, one ODB epoch per
`iter()`, with the bookkeeping the trainer callback needs (progress, ledger, metrics)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

from ..loader import ODBBatch, ODBDataLoader
from .run import SampleProgress
from .step_modes import StepMode


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
    """Iterating it yields the batches of one epoch on this rank (groups mode: one per
    micro-step; samples mode: one OptimizerStepBatch per optimizer step); when the epoch is
    over it tells the trainer (`should_epoch_stop`), since in groups mode HF's loop length is
    only an upper bound."""

    def __init__(self, loader: ODBDataLoader, mode: StepMode, progress: SampleProgress,
                 control_of: Callable[[], Any], epoch_samples: int, steps_per_epoch: int):
        self.loader = loader
        self.mode = mode
        self.progress = progress                # the run's (ODBRun.progress)
        self.control_of = control_of
        self.epoch_samples = epoch_samples    # samples one epoch trains over all ranks
        self.steps_per_epoch = steps_per_epoch  # samples mode: optimizer steps of an epoch (groups: 0)
        self.pending: List[ODBBatch] = []     # micro-steps since the last optimizer step
        self.epoch_consumed = 0               # samples of the current epoch, all ranks
        self.updates_per_epoch = 0            # HF's optimizer steps per epoch (set_initial_training_values)
        self.epoch_shift = 0                  # ODB epoch - HF epoch after a resume (callbacks._restore)

    def set_epoch(self, epoch: int) -> None:
        epoch += self.epoch_shift
        if epoch != self.loader.epoch:
            self.epoch_consumed = 0
        self.loader.set_epoch(epoch)

    @property
    def dataset(self):
        return self.loader.dataset

    def __len__(self) -> int:
        return self.mode.epoch_length(self)

    def steps_upper_bound(self) -> int:
        """Micro-steps one epoch can take at most: every step trains at least one sample
        on some rank, plus the IDLE steps that complete the last accumulation window."""
        ga = self.loader.config.gradient_accumulation_steps
        return ga * (math.ceil(self.epoch_samples / ga) + 1)

    def __iter__(self):
        yield from self.mode.hf_batches(self._micro_steps())
        control = self.control_of()
        if control is not None:
            control.should_epoch_stop = True

    def _micro_steps(self) -> Iterator[Tuple[ODBBatch, Dict[str, Any]]]:
        """The engine's micro-steps of this epoch with their batches, counted as they are taken."""
        for step in self.loader:
            batch = step.data
            if step.is_idle:
                batch["labels"] = torch.full_like(batch["labels"], -100)
            self.pending.append(step)
            self.epoch_consumed += step.global_num_samples
            self.progress.consumed += step.global_num_samples
            self.progress.input_tokens += step.input_tokens
            yield step, batch

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of this rank's data position (one JSON file per rank)."""
        return {"loader": self.loader.state_dict(), "epoch_consumed": self.epoch_consumed,
                "progress": [self.progress.consumed, self.progress.total]}

    def load_state_dict(self, saved: Dict[str, Any], global_step: int) -> None:
        """Put the loader where the checkpoint's run was. HF then starts its epoch loop at
        global_step // updates_per_epoch, which in groups mode (a per-epoch step bound) can be
        an earlier epoch than the loader's: the loader shifts HF's epoch numbers by the
        difference."""
        self.loader.load_state_dict(saved["loader"])
        self.epoch_consumed = saved["epoch_consumed"]
        self.progress.consumed, self.progress.total = saved["progress"]
        hf_epoch = global_step // max(1, self.updates_per_epoch)
        self.epoch_shift = max(0, saved["loader"]["epoch"] - hf_epoch)

    def take_pending(self) -> List[ODBBatch]:
        done, self.pending = self.pending, []
        return done
