"""The ODB trainer: LLaMA-Factory's SFT trainer with ODB's loader, exact loss and a
sample-driven schedule. `patches/odb_factory_patches/llamafactory_sft_workflow.py` hands it to `run_sft`
only when the run's YAML enables ODB."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType

from ..comm.topology import ranks_per_node
from ..loader import ODBDataLoader
from ..loss import weighted_token_sum
from ..planning.optimizer_steps import StandardStep
from ..segment_attention import FLASH_IMPLEMENTATIONS, decoder_config, packed_attention
from . import state
from .arguments import model_refusal
from .callbacks import ODBCallback
from .lazy_dataset import LazySupervisedDataset
from .padding_free import TOKEN_SAMPLE_KEY, PackedCollate, counted_tokens
from .train_loader import LFCollate, OptimizerStepBatch, TrainLoader

logger = logging.getLogger("odb_factory")

PACKED_ATTENTION_WORDS = {
    "varlen": "per sample through flash attention's varlen kernels",
    "segments": "per sample, one causal sdpa call each (no mask; odb_packed_attention: segments)",
    "mask": "through transformers' dense (Σ len)² block-causal mask (odb_packed_attention: mask)"}


def token_sum_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Sum of next-token cross entropy over label tokens / label tokens of the whole
    accumulation window on all ranks (HF counts and all-gathers `num_items_in_batch`, then
    multiplies by the world size, which DDP's gradient average divides back)."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    logits = logits[:, :-1, :].float()
    targets = labels[:, 1:].to(logits.device)
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                            ignore_index=-100, reduction="sum")
    if num_items_in_batch is None:
        num_items_in_batch = targets.ne(-100).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device).clamp(min=1)
    else:
        num_items_in_batch = max(1, num_items_in_batch)
    return total / num_items_in_batch


def sample_progress_lambda(original, num_training_steps: int):
    """An LR lambda evaluated at the run's sample progress instead of the optimizer step
    count: with variable batches the number of steps is only known at the end, samples
    are. A plain function, so LambdaLR saves no state for it (checkpoints stay loadable
    with weights_only=True) and the progress comes from the restored ODB state."""
    def lr_lambda(_step: int) -> float:
        return original(state.progress.fraction * num_training_steps)
    return lr_lambda


def _token_id(model_config: Any, kind: str) -> Optional[int]:
    """The model's `kind` (image, video, audio) placeholder token id: `<kind>_token_id`, or
    `<kind>_token_index` as the Omni configs name it."""
    for name in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(model_config, name, None)
        if value is not None:
            return int(value)
    return None


class ODBTrainerMixin:
    """Mixed in front of LLaMA-Factory's CustomSeq2SeqTrainer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._odb = state.active()
        self._odb_train_loader: Optional[TrainLoader] = None
        self._odb_samples_mode = self._odb.config.step_mode == "samples"
        self._odb_loss = self._odb_resolve_loss_scaling()
        if self._odb_loss == "exact" and not self._odb_samples_mode:
            self.compute_loss_func = token_sum_loss
        # ODB resumes its own data position from per-rank state (ODBCallback.on_train_begin);
        # HF must not re-skip batches.
        self.args.ignore_data_skip = True
        dataset = self.train_dataset
        row_of = dataset.dataset_row if isinstance(dataset, LazySupervisedDataset) else (lambda i: i)
        self._odb_callback = ODBCallback(lambda: self._odb_train_loader, self.args.process_index,
                                         self._odb.adapter.audit_dir, row_of,
                                         # samples mode: HF's step count is exact already
                                         max_steps_from_user=self.args.max_steps > 0 or self._odb_samples_mode,
                                         num_train_epochs=self.args.num_train_epochs)
        self.add_callback(self._odb_callback)
        model = self.accelerator.unwrap_model(self.model) if self.model is not None else None
        refusal = model_refusal(self._odb, getattr(getattr(model, "config", None), "model_type", None))
        if refusal is not None:  # a hub model id, not checked at parse time
            raise ValueError(refusal)
        self._odb_packed_attention = self._odb_choose_padding_free(model)
        if self._odb.vision_stage or self._odb.audio_stage:
            self._odb_balance_encoder_stages()
        self._odb_describe_steps()

    def _odb_choose_padding_free(self, model: Any) -> Optional[str]:
        """Settle `odb_padding_free` (auto: by the model) and switch the model's decoder to the
        attention packed rows need; logs which and why. Returns that attention (None: padded)."""
        if model is None:
            return None
        flash = getattr(decoder_config(model), "_attn_implementation", None) in FLASH_IMPLEMENTATIONS
        if not self._odb.decide_padding_free(getattr(model.config, "model_type", None), flash):
            logger.info("ODB: padded groups (%s)", self._odb.padding_free_reason)
            return None
        attention = packed_attention(model, self._odb.adapter.packed_attention)
        logger.info("ODB: padding-free groups (%s); packed rows attend %s", self._odb.padding_free_reason,
                    PACKED_ATTENTION_WORDS[attention])
        return attention

    def _odb_resolve_loss_scaling(self) -> str:
        """`standard`: what this run's fixed-batch trainer computes. LLaMA-Factory sets
        `model_accepts_loss_kwargs = False` for models with a processor (every VLM): each
        micro-batch's token mean, averaged; otherwise HF's global token mean."""
        chosen = self._odb.config.loss_scaling
        standard = ("micro_mean" if not self.model_accepts_loss_kwargs and self.compute_loss_func is None
                    else "exact")
        if not self._odb_samples_mode:
            return "exact" if chosen == "standard" else chosen
        if chosen == "standard":
            return standard
        if chosen != standard:
            logger.warning("ODB: odb_loss_scaling: %s differs from the loss the fixed-batch run computes "
                           "for this model (%s): the same samples, another weighting of their tokens",
                           chosen, standard)
        return chosen

    def _odb_describe_steps(self) -> None:
        args, cfg = self.args, self._odb.config
        if not self._odb_samples_mode:
            logger.warning("ODB: odb_step: groups: every optimizer step holds %d token-budgeted groups per "
                           "rank, not the recipe's %d samples per rank; the number of samples per "
                           "optimizer step is logged as odb/samples_per_optimizer_step",
                           cfg.gradient_accumulation_steps, args.per_device_train_batch_size
                           * cfg.gradient_accumulation_steps)
        elif args.per_device_train_batch_size * cfg.gradient_accumulation_steps == 1:
            logger.warning("ODB: odb_step: samples with one sample per rank and optimizer step leaves "
                           "nothing to group: the run is the fixed-batch run. Raise "
                           "gradient_accumulation_steps (the same global batch in fewer, fuller "
                           "micro-batches) or use odb_step: groups")

    def _odb_balance_encoder_stages(self) -> None:
        """Encoder-stage balancing (docs/encoder_balancing.md) over a group of its own, so its
        exchanges never interleave with DDP's or the loader's on a shared group. Within a
        forward both stages run in the same order on every rank, so they share it."""
        import datetime

        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        config = self._odb.config
        group = dist.new_group(timeout=datetime.timedelta(seconds=config.sync_timeout_s))
        options = dict(ranks_per_node=ranks_per_node(config.ranks_per_node, dist.get_world_size()),
                       timeout_s=config.sync_timeout_s)
        model = self.accelerator.unwrap_model(self.model)
        if getattr(model.config, "model_type", "").startswith("qwen2_5_omni"):
            from odb_factory_patches import transformers_qwen2_5_omni
            stages = tuple(s for s, on in (("audio", self._odb.audio_stage),
                                           ("vision", self._odb.vision_stage)) if on)
            transformers_qwen2_5_omni.apply(group, stages, **options)
        else:
            from odb_factory_patches import transformers_qwen3_vl
            transformers_qwen3_vl.apply(group=group, **options)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        if self._odb_train_loader is None:
            self._odb_train_loader = self._build_odb_loader()
        return self._odb_train_loader

    def _build_odb_loader(self) -> TrainLoader:
        args, odb = self.args, self._odb
        model = self.accelerator.unwrap_model(self.model) if self.model is not None else None
        model_config = getattr(model, "config", None)
        vision_ids = [t for t in (_token_id(model_config, "image"), _token_id(model_config, "video"))
                      if t is not None]
        audio_id = _token_id(model_config, "audio")
        vision_config = getattr(model_config, "vision_config", None)
        # The engine fields LLaMA-Factory owns (ODBConfig's `lf_source` says where each comes from).
        cfg = dataclasses.replace(
            odb.config,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            # samples mode: the recipe's accumulation, kept by the parser (HF's is 1)
            gradient_accumulation_steps=(odb.config.gradient_accumulation_steps if self._odb_samples_mode
                                         else args.gradient_accumulation_steps),
            loss_scaling=self._odb_loss,
            standard_batch_size=args.per_device_train_batch_size,
            pad_epoch_to_accumulation=True,
            # lazy preprocessing belongs in worker processes, not beside the trainer
            num_workers=max(1, args.dataloader_num_workers),
            pad_to_multiple_of=getattr(self.data_collator, "pad_to_multiple_of", None) or 1,
            vision_token_ids=tuple(vision_ids),
            audio_token_ids=(audio_id,) if audio_id is not None else (),
            spatial_merge_size=getattr(vision_config, "spatial_merge_size", 2),
            balance=odb.config.balance)
        standard_steps = self._odb_standard_steps if self._odb_samples_mode else None
        collate = LFCollate(self.data_collator)
        if odb.padding_free:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
            collate = PackedCollate(collate, odb.adapter.padding_free_row_tokens,
                                    getattr(tokenizer, "pad_token_id", None) or 0)
        loader = ODBDataLoader(self.train_dataset, cfg, collate_fn=collate,
                               standard_steps=standard_steps)
        steps_per_epoch = 0
        if self._odb_samples_mode:
            first = self._odb_standard_steps(0)
            steps_per_epoch = len(first)
            epoch_samples = sum(len(s.indices) for s in first) * args.world_size
        else:
            epoch_samples = cfg.quota if (not cfg.join and cfg.quota) else len(self.train_dataset)
        epochs = args.num_train_epochs if args.max_steps <= 0 else 1
        state.progress.start(int(math.ceil(epoch_samples * epochs)))  # a resume restores it later
        return TrainLoader(loader, lambda: getattr(self, "control", None), epoch_samples, steps_per_epoch)

    def _odb_standard_steps(self, epoch: int) -> List[StandardStep]:
        """This rank's optimizer steps of the fixed-batch run, from the Trainer's own sampler
        through accelerate's sharding (the same global batches, the same wrap-around of the
        last one), without loading a sample; RNG state is left as it was."""
        from torch.utils.data import DataLoader
        indices = DataLoader(range(len(self.train_dataset)), batch_size=self._train_batch_size,
                             sampler=self._get_train_sampler(), collate_fn=list,
                             drop_last=self.args.dataloader_drop_last)
        sharded = self.accelerator.prepare_data_loader(indices)
        if sharded in self.accelerator._dataloaders:
            self.accelerator._dataloaders.remove(sharded)  # a planning aid, not a training loader
        sharded.set_epoch(epoch)
        with torch.random.fork_rng(devices=[]):
            batches = [tuple(int(i) for i in batch) for batch in sharded]
        accumulation = self._odb.config.gradient_accumulation_steps
        return [StandardStep(tuple(batches[k:k + accumulation])) for k in range(0, len(batches), accumulation)]

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # on_train_begin restores ODB's data position from this checkpoint (HF's own resume
        # skips nothing: ignore_data_skip)
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
        self._odb_callback.resume_from = resume_from_checkpoint or None
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            # the loader's worker processes end with the training (its state and metrics stay
            # readable), not whenever the trainer happens to be collected
            if self._odb_train_loader is not None:
                self._odb_train_loader.loader.close()

    def set_initial_training_values(self, args, dataloader, *total_train_batch_size):
        """HF's 7-tuple of epochs and steps. transformers 5.x calls it with (args, dataloader)
        and reads (..., total batch, steps in epoch, max steps); 4.57 passes the total batch
        and reads (..., epoch_based, len_dataloader, max steps)."""
        loader: TrainLoader = dataloader
        if self._odb_samples_mode:  # the fixed-batch run's steps: HF's own count is exact
            values = super().set_initial_training_values(args, dataloader, *total_train_batch_size)
            loader.updates_per_epoch = values[1]
            return values
        bound = loader.steps_upper_bound()
        updates_per_epoch = bound // args.gradient_accumulation_steps
        loader.updates_per_epoch = updates_per_epoch
        total_batch = self.get_total_train_batch_size(args)
        examples = len(loader.dataset)
        if args.max_steps > 0:
            max_steps, epochs = args.max_steps, sys.maxsize
            samples = max_steps * total_batch
        else:
            epochs = math.ceil(args.num_train_epochs)
            max_steps = self._odb_estimate_steps(loader, args)
            samples = state.progress.total
        if total_train_batch_size:  # transformers 4.57
            return epochs, updates_per_epoch, examples, samples, args.max_steps < 0, bound, max_steps
        return epochs, updates_per_epoch, examples, samples, total_batch, bound, max_steps

    def _odb_estimate_steps(self, loader: TrainLoader, args) -> int:
        """A first estimate of optimizer steps (the progress bar and warmup_steps use it; the
        schedule itself follows samples): the budget over the mean cost of a few samples."""
        dataset = loader.dataset
        probe = [dataset[i] for i in range(0, len(dataset), max(1, len(dataset) // 16))][:16]
        mean_len = sum(len(s["input_ids"]) for s in probe) / max(1, len(probe))
        per_group = max(1.0, self._odb.config.token_budget / max(1.0, mean_len * 1.25))
        world = max(1, args.world_size)
        micro_steps = state.progress.total / (per_group * world)
        return max(1, math.ceil(micro_steps / args.gradient_accumulation_steps))

    # ------------------------------------------------------------------ schedule and logs
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.args.max_steps <= 0 and not self._odb_samples_mode:
            lambdas = getattr(scheduler, "lr_lambdas", None)
            if lambdas is None:
                logger.warning("ODB: %s is not a LambdaLR; its schedule follows optimizer steps "
                               "(an estimate with variable batches)", type(scheduler).__name__)
            else:
                scheduler.lr_lambdas = [sample_progress_lambda(f, num_training_steps) for f in lambdas]
        return scheduler

    # ------------------------------------------------------------------ samples mode
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Samples mode: one optimizer step's micro-batches; gradients are synchronised (and
        DeepSpeed steps) on the last one only. Returns the step's loss on this rank, which
        HF averages over ranks for the log: the fixed-batch run's loss."""
        if not isinstance(inputs, OptimizerStepBatch):
            return super().training_step(model, inputs, num_items_in_batch)
        total = None
        last = len(inputs.micro_batches) - 1
        for i, batch in enumerate(inputs.micro_batches):
            self.accelerator.gradient_state._set_sync_gradients(i == last)
            deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
            context = (contextlib.nullcontext() if i == last or deepspeed
                       else self.accelerator.no_sync(model=model))
            with context:
                loss = super().training_step(model, batch, None)
            total = loss if total is None else total + loss
        return total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs.pop(TOKEN_SAMPLE_KEY, None)  # a packed row's token owners: for the loader and the counts
        weights = inputs.pop("odb_sample_weights", None)
        if weights is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        loss = weighted_token_sum(logits.float(), labels.to(logits.device), weights.to(logits.device))
        return (loss, outputs) if return_outputs else loss

    def floating_point_ops(self, inputs):
        if isinstance(inputs, OptimizerStepBatch):
            return sum(super(ODBTrainerMixin, self).floating_point_ops(b) for b in inputs.micro_batches)
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs):
        if isinstance(inputs, OptimizerStepBatch):
            for batch in inputs.micro_batches:
                super()._track_num_input_tokens(counted_tokens(batch))
            return
        super()._track_num_input_tokens(counted_tokens(inputs))

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            logs.update(self._odb_callback.pop_log_metrics())
        return super().log(logs, *args, **kwargs)
