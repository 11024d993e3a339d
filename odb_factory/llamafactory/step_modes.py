"""The two step modes (`odb_step`), each one strategy: everything that differs between them in
the parser, the trainer and the train loader is a method here, so no other file asks which
mode it runs in.

- `samples` (`SamplesMode`): the fixed-batch run's optimizer steps, each packed into fewer,
  token-budgeted micro-batches; HF accumulates over 1 and receives one step at a time; the
  loss is the fixed-batch run's (per-sample weights); HF's step count is exact.
- `groups` (`GroupsMode`): the paper's steps, N token-budgeted groups per rank and optimizer
  step; HF accumulates over N micro-batches; the loss is a token sum over the window; the
  number of steps is known at the end only, so the schedule follows samples.

Padding-free rows are a property of the collation (`padding_free.PackedCollate`) and run in
either mode unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from ..config import ODBConfig, typed_dataclass
from ..loader import ODBBatch
from ..loss import weighted_token_sum
from ..planning.optimizer_steps import StandardStep
from .padding_free import TOKEN_SAMPLE_KEY, counted_tokens, token_weights

logger = logging.getLogger("odb_factory")

# Groups mode's first step estimate (the progress bar and warmup_steps use it; the callback
# corrects it as samples are consumed): a padded group's real tokens over its padded cost,
# typical of the length-sorted groups the planner forms. A packed group costs its real tokens.
PADDED_GROUP_FILL = 0.8
# `odb_token_budget: auto` in samples mode on CPU: long packed rows cost more per token there once
# the ranks run short of memory (bench/reference/row-size-2026-12-07, docs/padding_free.md)
CPU_SAMPLES_TOKEN_BUDGET = 1024


def token_sum_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None,
                   positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum of next-token cross entropy over label tokens / label tokens of the whole
    accumulation window on all ranks (HF counts and all-gathers `num_items_in_batch`, then
    multiplies by the world size, which DDP's gradient average divides back). `positions`:
    the logits are those of these positions only (`supervised_positions`)."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    labels = labels.to(logits.device)
    total = weighted_token_sum(logits.float(), labels, torch.ones(labels.shape[0], device=logits.device),
                               positions=positions)
    if num_items_in_batch is None:
        num_items_in_batch = labels[:, 1:].ne(-100).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device).clamp(min=1)
    else:
        num_items_in_batch = max(1, num_items_in_batch)
    return total / num_items_in_batch


def sample_progress_lambda(original: Callable[[float], float], num_training_steps: int,
                           progress: Any) -> Callable[[int], float]:
    """An LR lambda evaluated at the run's sample progress instead of the optimizer step
    count: with variable batches the number of steps is only known at the end, samples
    are. Reads `progress` (the run's SampleProgress, restored on resume) when called; LambdaLR
    saves no state for a closure, so checkpoints stay loadable with weights_only=True."""
    def lr_lambda(_step: int) -> float:
        return original(progress.fraction * num_training_steps)
    return lr_lambda


class OptimizerStepBatch:
    """Samples mode: what HF's loop receives as one batch, the micro-batches of one optimizer
    step (HF accumulates over 1; `SamplesMode.training_step` runs them)."""

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


def micro_batches_of(inputs: Any) -> List[Dict[str, Any]]:
    """The micro-batches HF's one batch stands for (one, unless it is a samples-mode step)."""
    return inputs.micro_batches if isinstance(inputs, OptimizerStepBatch) else [inputs]


class StepMode:
    """What the parser, the trainer and the train loader ask of a step mode."""

    name: str
    # True: HF's optimizer-step count is the run's; False: an estimate the callback keeps
    # ahead of the real count until the data runs out
    hf_counts_steps: bool

    # ------------------------------------------------------------------ parser
    def lf_arguments(self, options: Any, raw: Mapping[str, Any]) -> Dict[str, Any]:
        """The YAML keys LLaMA-Factory builds its TrainingArguments from."""
        return dict(raw)

    def pairs_refusal(self) -> Optional[str]:
        """Why this mode cannot train preference pairs (stage dpo; None: it can)."""
        return None

    # ------------------------------------------------------------------ trainer set-up
    def loss_scaling(self, chosen: str, fixed_batch_loss: str) -> str:
        """The loss the run computes, from `odb_loss_scaling` and the loss the fixed-batch
        trainer computes for this model."""
        raise NotImplementedError

    def loss_function(self, loss_scaling: str) -> Optional[Callable[..., torch.Tensor]]:
        """A `compute_loss_func` for HF's trainer (None: keep the trainer's)."""
        return None

    def describe(self, per_device_batch: int, accumulation: int) -> None:
        """Start-up log lines a user needs about the steps (`accumulation`: the run's micro-batches
        per optimizer step, `engine_accumulation`)."""

    def engine_accumulation(self, config: ODBConfig, hf_accumulation: int) -> int:
        """gradient_accumulation_steps of the engine's configuration."""
        raise NotImplementedError

    def auto_token_budget(self, on_cpu: bool, default: int) -> Tuple[int, str]:
        """(budget, why) for `odb_token_budget: auto` on CPU or an accelerator (`default`: the
        engine's budget)."""
        raise NotImplementedError

    def auto_balance(self, world_size: int) -> Tuple[bool, str]:
        """(on, why) for `odb_balance: auto` on `world_size` ranks (the LLM stage's sample
        exchange)."""
        raise NotImplementedError

    def standard_steps(self, trainer: Any) -> Optional[Callable[[int], List[StandardStep]]]:
        """The fixed-batch run's optimizer steps per epoch, for the engine (None: not used)."""
        return None

    def epoch_extent(self, trainer: Any, config: ODBConfig, dataset_size: int) -> Tuple[int, int]:
        """(samples one epoch trains over all ranks, optimizer steps of an epoch or 0)."""
        raise NotImplementedError

    def initial_training_values(self, trainer: Any, args: Any, loader: Any, upstream: Callable[[], tuple],
                                transformers_4: bool) -> tuple:
        """HF's 7-tuple of epochs and steps (`Trainer.set_initial_training_values`)."""
        raise NotImplementedError

    def schedule(self, scheduler: Any, num_training_steps: int, args: Any, progress: Any) -> Any:
        return scheduler

    def training_step(self, trainer: Any, model: Any, inputs: Any, upstream: Callable[..., torch.Tensor],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        return upstream(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------ train loader
    def epoch_length(self, train_loader: Any) -> int:
        """len() of the loader HF iterates."""
        raise NotImplementedError

    def hf_batches(self, steps: Iterable[Tuple[ODBBatch, Dict[str, Any]]]) -> Iterator[Any]:
        """HF's batches from the engine's micro-steps (each with its collated batch)."""
        raise NotImplementedError


class SamplesMode(StepMode):
    name = "samples"
    hf_counts_steps = True

    def lf_arguments(self, options: Any, raw: Mapping[str, Any]) -> Dict[str, Any]:
        """ODB runs a variable number of micro-batches per optimizer step, handed to HF as one
        item, so HF (and DeepSpeed) must accumulate over 1; the recipe's
        `gradient_accumulation_steps` becomes the fixed-batch run ODB reproduces. Set before
        LLaMA-Factory builds TrainingArguments (a DeepSpeed config filled from them must agree)."""
        accumulation = typed_dataclass(ODBConfig, {"gradient_accumulation_steps": raw.get(
            "gradient_accumulation_steps", 1)}).gradient_accumulation_steps
        options.config = dataclasses.replace(options.config, gradient_accumulation_steps=accumulation)
        return dict(raw, gradient_accumulation_steps=1)

    def loss_scaling(self, chosen: str, fixed_batch_loss: str) -> str:
        if chosen == "standard":
            return fixed_batch_loss
        if chosen != fixed_batch_loss:
            logger.warning("ODB: odb_loss_scaling: %s differs from the loss the fixed-batch run computes "
                           "for this model (%s): the same samples, another weighting of their tokens",
                           chosen, fixed_batch_loss)
        return chosen

    def describe(self, per_device_batch: int, accumulation: int) -> None:
        if per_device_batch * accumulation == 1:
            logger.warning("ODB: odb_step: samples with one sample per rank and optimizer step leaves "
                           "nothing to group: the run is the fixed-batch run. Raise "
                           "gradient_accumulation_steps (the same global batch in fewer, fuller "
                           "micro-batches) or use odb_step: groups")

    def engine_accumulation(self, config: ODBConfig, hf_accumulation: int) -> int:
        return config.gradient_accumulation_steps  # the recipe's, kept by the parser (HF's is 1)

    def auto_token_budget(self, on_cpu: bool, default: int) -> Tuple[int, str]:
        # the budget only cuts the fixed-batch run's steps into micro-batches: it may follow the device
        if on_cpu:
            return CPU_SAMPLES_TOKEN_BUDGET, ("odb_token_budget: auto, odb_step: samples on CPU, where a packed "
                                              "row costs more per token once memory runs short; the model is the same")
        return default, "odb_token_budget: auto, odb_step: samples on an accelerator"

    def auto_balance(self, world_size: int) -> Tuple[bool, str]:
        if world_size < 2:
            return False, "odb_balance: auto, one rank: nothing to re-deal"
        # a step's samples only change ranks: the same model (bench/reference/cpu-layer-2026-12-07-cv1-mean256-balance)
        return True, (f"odb_balance: auto, odb_step: samples on {world_size} ranks: each micro-step's samples are "
                      "re-dealt so the ranks carry even costs; the model is the same")

    def standard_steps(self, trainer: Any) -> Callable[[int], List[StandardStep]]:
        return trainer._odb_standard_steps

    def epoch_extent(self, trainer: Any, config: ODBConfig, dataset_size: int) -> Tuple[int, int]:
        first = trainer._odb_standard_steps(0)
        return sum(len(s.indices) for s in first) * trainer.args.world_size, len(first)

    def initial_training_values(self, trainer, args, loader, upstream, transformers_4):
        values = upstream()  # the fixed-batch run's steps: HF's own count is exact
        loader.updates_per_epoch = values[1]
        return values

    def training_step(self, trainer, model, inputs, upstream, num_items_in_batch=None):
        """One optimizer step's micro-batches; gradients are synchronised (and DeepSpeed steps)
        on the last one only. Returns the step's loss on this rank, which HF averages over
        ranks for the log: the fixed-batch run's loss."""
        from accelerate.utils import DistributedType
        accelerator = trainer.accelerator
        total = None
        last = len(inputs.micro_batches) - 1
        for i, batch in enumerate(inputs.micro_batches):
            accelerator.gradient_state._set_sync_gradients(i == last)
            deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
            context = contextlib.nullcontext() if i == last or deepspeed else accelerator.no_sync(model=model)
            with context:
                loss = upstream(model, batch, None)
            total = loss if total is None else total + loss
        return total

    def epoch_length(self, train_loader: Any) -> int:
        return train_loader.steps_per_epoch

    def hf_batches(self, steps):
        micro_batches: List[Dict[str, Any]] = []
        for step, batch in steps:
            batch["odb_sample_weights"] = self.loss_weights(step, batch.get(TOKEN_SAMPLE_KEY))
            micro_batches.append(batch)
            if step.optimizer_step_end:
                yield OptimizerStepBatch(micro_batches)
                micro_batches = []

    @staticmethod
    def loss_weights(step: ODBBatch, token_sample: Optional[torch.Tensor]) -> torch.Tensor:
        """Each sample's loss weight, per sample (padded) or per token (padding-free: a row
        holds several samples); zeros for an IDLE step."""
        if token_sample is not None:
            weights = token_weights(step.sample_weights, token_sample)
            return weights * 0.0 if step.is_idle else weights
        # (an IDLE step trains one filler sample)
        return torch.tensor(step.sample_weights if not step.is_idle else [0.0], dtype=torch.float32)


class GroupsMode(StepMode):
    name = "groups"
    hf_counts_steps = False

    def pairs_refusal(self) -> Optional[str]:
        return "a DPO loss is a mean over pairs, which a token-budgeted window of groups does not weigh"

    def loss_scaling(self, chosen: str, fixed_batch_loss: str) -> str:
        return "exact" if chosen == "standard" else chosen

    def loss_function(self, loss_scaling: str) -> Optional[Callable[..., torch.Tensor]]:
        return token_sum_loss if loss_scaling == "exact" else None

    def describe(self, per_device_batch: int, accumulation: int) -> None:
        logger.warning("ODB: odb_step: groups: every optimizer step holds %d token-budgeted group%s per "
                       "rank, not the recipe's %d samples per rank; the number of samples per "
                       "optimizer step is logged as odb/samples_per_optimizer_step",
                       accumulation, "" if accumulation == 1 else "s", per_device_batch * accumulation)

    def engine_accumulation(self, config: ODBConfig, hf_accumulation: int) -> int:
        return hf_accumulation

    def auto_token_budget(self, on_cpu: bool, default: int) -> Tuple[int, str]:
        return default, ("odb_token_budget: auto, odb_step: groups (the budget makes the optimizer steps, "
                         "so it does not follow the device)")

    def auto_balance(self, world_size: int) -> Tuple[bool, str]:
        return False, "odb_balance: auto, odb_step: groups (set odb_balance: true to post-balance its groups)"

    def epoch_extent(self, trainer: Any, config: ODBConfig, dataset_size: int) -> Tuple[int, int]:
        return (config.quota if (not config.join and config.quota) else dataset_size), 0

    def initial_training_values(self, trainer, args, loader, upstream, transformers_4):
        bound = loader.steps_upper_bound()
        updates_per_epoch = bound // args.gradient_accumulation_steps
        loader.updates_per_epoch = updates_per_epoch
        total_batch = trainer.get_total_train_batch_size(args)
        examples = len(loader.dataset)
        if args.max_steps > 0:
            max_steps, epochs = args.max_steps, sys.maxsize
            samples = max_steps * total_batch
        else:
            epochs = math.ceil(args.num_train_epochs)
            max_steps = self.estimate_steps(loader, args, trainer.odb_run)
            samples = trainer.odb_run.progress.total
        if transformers_4:
            return epochs, updates_per_epoch, examples, samples, args.max_steps < 0, bound, max_steps
        return epochs, updates_per_epoch, examples, samples, total_batch, bound, max_steps

    @staticmethod
    def estimate_steps(loader: Any, args: Any, run: Any) -> int:
        """A first estimate of optimizer steps: the budget over the mean cost of a few samples."""
        dataset, config = loader.dataset, run.options.config
        probe = [dataset[i] for i in range(0, len(dataset), max(1, len(dataset) // 16))][:16]
        mean_len = sum(len(s["input_ids"]) for s in probe) / max(1, len(probe))
        fill = 1.0 if config.cost_mode == "packed" else PADDED_GROUP_FILL
        per_group = max(1.0, config.token_budget * fill / max(1.0, mean_len))
        micro_steps = run.progress.total / (per_group * max(1, args.world_size))
        return max(1, math.ceil(micro_steps / args.gradient_accumulation_steps))

    def schedule(self, scheduler, num_training_steps, args, progress):
        if args.max_steps > 0:
            return scheduler
        lambdas = getattr(scheduler, "lr_lambdas", None)
        if lambdas is None:
            logger.warning("ODB: %s is not a LambdaLR; its schedule follows optimizer steps "
                           "(an estimate with variable batches)", type(scheduler).__name__)
        else:
            scheduler.lr_lambdas = [sample_progress_lambda(f, num_training_steps, progress) for f in lambdas]
        return scheduler

    def epoch_length(self, train_loader: Any) -> int:
        """The bound HF's loop runs to (transformers 4.57 reads it as the epoch's length); the
        epoch ends earlier, through `should_epoch_stop`."""
        return train_loader.steps_upper_bound()

    def hf_batches(self, steps):
        for _, batch in steps:
            yield batch


STEP_MODES = (SamplesMode, GroupsMode)


def step_mode(name: str) -> StepMode:
    """The strategy of `odb_step: name`."""
    for mode in STEP_MODES:
        if mode.name == name:
            return mode()
    raise ValueError(f"odb_step: {name!r} is not one of {[m.name for m in STEP_MODES]}")
