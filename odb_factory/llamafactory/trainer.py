"""The ODB trainer: LLaMA-Factory's SFT trainer with ODB's loader, exact loss and a
sample-driven schedule. `patches/odb_factory_patches/llamafactory_sft_workflow.py` hands it to `run_sft`, with the
run's `ODBRun`, only when the run's YAML enables ODB. What differs between the step modes is
the run's `StepMode` (step_modes.py)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from types import MappingProxyType
from typing import Any, List, Optional

import torch

from ..comm.topology import ranks_per_node
from ..loader import ODBDataLoader
from ..loss import supervised_positions, weighted_token_sum
from ..planning.optimizer_steps import StandardStep
from ..segment_attention import FLASH_IMPLEMENTATIONS, decoder_config, packed_attention
from .arguments import model_refusal
from .callbacks import ODBCallback
from .lazy_dataset import LazySupervisedDataset
from .padding_free import TOKEN_SAMPLE_KEY, PackedCollate, counted_tokens
from .run import ODBRun
from .step_modes import micro_batches_of
from .train_loader import LFCollate, TrainLoader

logger = logging.getLogger("odb_factory")

PACKED_ATTENTION_WORDS = MappingProxyType({
    "varlen": "per sample through flash attention's varlen kernels",
    "segments": "per sample, one causal sdpa call each (no mask; odb_packed_attention: segments)",
    "mask": "through transformers' dense (Σ len)² block-causal mask (odb_packed_attention: mask)"})


# train()'s metrics: LLM input tokens trained on all ranks (read by the patched calculate_tps)
ODB_INPUT_TOKENS = "odb_input_tokens"


def show_odb_log(main_process: bool) -> None:
    """Print the `odb_factory` logger's lines where LLaMA-Factory prints its own, through its
    handlers (without a handler Python shows warnings only, unformatted): info lines on the
    main process, warnings on every rank."""
    for handler in logging.getLogger("llamafactory").handlers:
        if handler not in logger.handlers:
            logger.addHandler(handler)
    logger.setLevel(logging.INFO if main_process else logging.WARNING)


def takes_logits_to_keep(model: Any) -> bool:
    """Whether the model's forward computes logits at chosen positions only (`logits_to_keep`,
    an index tensor); a PEFT model passes it through to its base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _token_id(model_config: Any, kind: str) -> Optional[int]:
    """The model's `kind` (image, video, audio) placeholder token id: `<kind>_token_id`, or
    `<kind>_token_index` as the Omni configs name it."""
    for name in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(model_config, name, None)
        if value is not None:
            return int(value)
    return None


class ODBTrainerMixin:
    """Mixed in front of LLaMA-Factory's CustomSeq2SeqTrainer; `odb_run` is the run's ODBRun."""

    def __init__(self, *args, odb_run: ODBRun, **kwargs):
        super().__init__(*args, **kwargs)
        show_odb_log(self.args.should_log)
        self.odb_run = odb_run
        self._odb = odb_run.options
        self._odb_mode = odb_run.step_mode
        self._odb_train_loader: Optional[TrainLoader] = None
        self._odb_loss = self._odb_resolve_loss_scaling()
        loss_function = self._odb_mode.loss_function(self._odb_loss)
        if loss_function is not None:
            self.compute_loss_func = self._odb_window_loss
            self._odb_window_loss_function = loss_function
        self._odb_logits_kept: Optional[torch.Tensor] = None  # the positions a training forward computed
        # ODB resumes its own data position from per-rank state (ODBCallback.on_train_begin);
        # HF must not re-skip batches.
        self.args.ignore_data_skip = True
        dataset = self.train_dataset
        row_of = dataset.dataset_row if isinstance(dataset, LazySupervisedDataset) else (lambda i: i)
        self._odb_callback = ODBCallback(lambda: self._odb_train_loader, odb_run.progress, self.args.process_index,
                                         self._odb.adapter.audit_dir, row_of,
                                         max_steps_from_user=self.args.max_steps > 0 or self._odb_mode.hf_counts_steps,
                                         num_train_epochs=self.args.num_train_epochs,
                                         progress_bar_of=self._odb_progress_bar)
        self.add_callback(self._odb_callback)
        model = self.accelerator.unwrap_model(self.model) if self.model is not None else None
        refusal = model_refusal(self._odb, getattr(getattr(model, "config", None), "model_type", None))
        if refusal is not None:  # a hub model id, not checked at parse time
            raise ValueError(refusal)
        self._odb_packed_attention = self._odb_choose_padding_free(model)
        self._odb_supervised_logits = self._odb_choose_supervised_logits(model)
        # before the loader exists: it plans with the budget
        budget = self._odb.decide_token_budget(on_cpu=self.args.device.type == "cpu")
        if self._odb.token_budget_reason:
            logger.info("ODB: odb_token_budget %d (%s)", budget, self._odb.token_budget_reason)
        balance = self._odb.decide_balance(self.args.world_size)
        if self._odb.balance_reason:
            logger.info("ODB: post-balancing %s (%s)", "on" if balance else "off", self._odb.balance_reason)
        if self._odb.vision_stage or self._odb.audio_stage:
            self._odb_callback.encoder_stages.balancers = self._odb_balance_encoder_stages()
        self._odb_mode.describe(self.args.per_device_train_batch_size, self._odb_mode.engine_accumulation(
            self._odb.config, self.args.gradient_accumulation_steps))

    def _odb_progress_bar(self) -> Any:
        """HF's training progress bar (ProgressCallback.training_bar; None where not shown)."""
        from transformers.trainer_callback import ProgressCallback
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback):
                return callback.training_bar
        return None

    def _odb_choose_padding_free(self, model: Any) -> Optional[str]:
        """Settle `odb_padding_free` (auto: by the model) and switch the model's decoder to the
        attention packed rows need; logs which and why. Returns that attention (None: padded)."""
        if model is None:
            return None
        flash = decoder_config(model)._attn_implementation in FLASH_IMPLEMENTATIONS  # every config has one
        if not self._odb.decide_padding_free(getattr(model.config, "model_type", None), flash):
            logger.info("ODB: padded groups (%s)", self._odb.padding_free_reason)
            return None
        attention = packed_attention(model, self._odb.adapter.packed_attention)
        logger.info("ODB: padding-free groups (%s); packed rows attend %s", self._odb.padding_free_reason,
                    PACKED_ATTENTION_WORDS[attention])
        return attention

    def _odb_choose_supervised_logits(self, model: Any) -> bool:
        """`odb_supervised_logits`, where the model's forward takes `logits_to_keep`."""
        if not self._odb.adapter.supervised_logits or model is None:
            return False
        if not takes_logits_to_keep(model):
            logger.info("ODB: logits at every position (%s.forward takes no logits_to_keep)", type(model).__name__)
            return False
        return True

    def _odb_resolve_loss_scaling(self) -> str:
        """`standard`: what this run's fixed-batch trainer computes. LLaMA-Factory sets
        `model_accepts_loss_kwargs = False` for models with a processor (every VLM): each
        micro-batch's token mean, averaged; otherwise HF's global token mean."""
        fixed_batch_loss = ("micro_mean" if not self.model_accepts_loss_kwargs and self.compute_loss_func is None
                            else "exact")
        return self._odb_mode.loss_scaling(self._odb.config.loss_scaling, fixed_batch_loss)

    def _odb_balance_encoder_stages(self) -> List[Any]:
        """Encoder-stage balancing (docs/encoder_balancing.md) over a group of its own, so its
        exchanges never interleave with DDP's or the loader's on a shared group. Within a
        forward both stages run in the same order on every rank, so they share it. Applies
        the model's patch (odb_factory.encoder_stage) and returns (stage, balancer) pairs."""
        import datetime

        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return []
        config = self._odb.config
        group = dist.new_group(timeout=datetime.timedelta(seconds=config.sync_timeout_s))
        options = dict(ranks_per_node=ranks_per_node(config.ranks_per_node, dist.get_world_size()),
                       timeout_s=config.sync_timeout_s)
        model = self.accelerator.unwrap_model(self.model)
        if model.config.model_type.startswith("qwen2_5_omni"):
            from ..encoder_stage import qwen2_5_omni_patch
            stages = tuple(s for s, on in (("audio", self._odb.audio_stage),
                                           ("vision", self._odb.vision_stage)) if on)
            qwen2_5_omni_patch.apply(group, stages, **options)
            return [(stage, qwen2_5_omni_patch.balancer(stage)) for stage in stages]
        from ..encoder_stage import qwen3_vl_patch
        return [("vision", qwen3_vl_patch.apply(group=group, **options))]

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
            gradient_accumulation_steps=self._odb_mode.engine_accumulation(odb.config,
                                                                           args.gradient_accumulation_steps),
            loss_scaling=self._odb_loss,
            standard_batch_size=args.per_device_train_batch_size,
            pad_epoch_to_accumulation=True,
            # lazy preprocessing belongs in worker processes, not beside the trainer
            num_workers=max(1, args.dataloader_num_workers),
            pad_to_multiple_of=getattr(self.data_collator, "pad_to_multiple_of", None) or 1,
            vision_token_ids=tuple(vision_ids),
            audio_token_ids=(audio_id,) if audio_id is not None else (),
            spatial_merge_size=getattr(vision_config, "spatial_merge_size", 2))
        collate = LFCollate(self.data_collator)
        if odb.padding_free:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
            collate = PackedCollate(collate, odb.adapter.padding_free_row_tokens,
                                    getattr(tokenizer, "pad_token_id", None) or 0)
        loader = ODBDataLoader(self.train_dataset, cfg, collate_fn=collate, cost_fn=self._odb_cost_fn(cfg),
                               standard_steps=self._odb_mode.standard_steps(self))
        epoch_samples, steps_per_epoch = self._odb_mode.epoch_extent(self, cfg, len(self.train_dataset))
        epochs = args.num_train_epochs if args.max_steps <= 0 else 1
        self.odb_run.progress.start(int(math.ceil(epoch_samples * epochs)))  # a resume restores it later
        return TrainLoader(loader, self._odb_mode, self.odb_run.progress, lambda: getattr(self, "control", None),
                           epoch_samples, steps_per_epoch)

    def _odb_cost_fn(self, config: Any) -> Optional[Any]:
        """The samples' cost function (None: the engine's DefaultCost for `config`)."""
        return None

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
            output = super().train(resume_from_checkpoint, *args, **kwargs)
            output.metrics[ODB_INPUT_TOKENS] = self._odb_input_tokens_all_ranks()
            return output
        finally:
            # the loader's worker processes end with the training (its state and metrics stay
            # readable), not whenever the trainer happens to be collected
            if self._odb_train_loader is not None:
                self._odb_train_loader.loader.close()

    def _odb_input_tokens_all_ranks(self) -> int:
        import torch.distributed as dist
        tokens = torch.tensor(float(self.odb_run.progress.input_tokens), dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                tokens = tokens.cuda()
            dist.all_reduce(tokens)
        return int(tokens.item())

    def set_initial_training_values(self, args, dataloader, *total_train_batch_size):
        """HF's 7-tuple of epochs and steps. transformers 5.x calls it with (args, dataloader)
        and reads (..., total batch, steps in epoch, max steps); 4.57 passes the total batch
        and reads (..., epoch_based, len_dataloader, max steps)."""
        def upstream() -> tuple:
            return super(ODBTrainerMixin, self).set_initial_training_values(args, dataloader, *total_train_batch_size)
        return self._odb_mode.initial_training_values(self, args, dataloader, upstream,
                                                      transformers_4=bool(total_train_batch_size))

    # ------------------------------------------------------------------ schedule and logs
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        return self._odb_mode.schedule(scheduler, num_training_steps, self.args, self.odb_run.progress)

    def training_step(self, model, inputs, num_items_in_batch=None):
        return self._odb_mode.training_step(self, model, inputs, super().training_step, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs.pop(TOKEN_SAMPLE_KEY, None)  # a packed row's token owners: for the loader and the counts
        supervised = self._odb_keeps_supervised_logits(inputs)
        weights = inputs.pop("odb_sample_weights", None)
        if weights is None:
            # groups mode: HF's loss call, the window's token sum, at the supervised positions
            # only when training (evaluation's metrics read every position's logits)
            kept = model.training and supervised
            self._odb_logits_kept = supervised_positions(inputs["labels"]) if kept else None
            if kept:
                inputs["logits_to_keep"] = self._odb_logits_kept
            try:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            finally:
                self._odb_logits_kept = None
        labels = inputs.pop("labels")
        positions = supervised_positions(labels) if supervised else None
        if positions is not None:
            inputs["logits_to_keep"] = positions
        outputs = model(**inputs)
        logits = outputs.logits  # a ModelOutput
        loss = weighted_token_sum(logits.float(), labels.to(logits.device), weights.to(logits.device),
                                  positions=None if positions is None else positions.to(logits.device))
        return (loss, outputs) if return_outputs else loss

    def _odb_keeps_supervised_logits(self, inputs) -> bool:
        """Whether a training forward of `inputs` computes logits at the supervised positions
        only (`odb_supervised_logits`, on a model that takes `logits_to_keep`): a `samples`-mode
        micro-batch (its weighted token loss), or a `groups`-mode one whose loss is the window's
        token sum; LLaMA-Factory's own losses (`odb_loss_scaling: none`) read every position."""
        return (self._odb_supervised_logits and "labels" in inputs
                and ("odb_sample_weights" in inputs or self.compute_loss_func == self._odb_window_loss))

    def _odb_window_loss(self, outputs, labels, num_items_in_batch=None):
        """The step mode's loss over HF's accumulation window (groups mode: `token_sum_loss`),
        over the logits this forward computed."""
        return self._odb_window_loss_function(outputs, labels, num_items_in_batch, positions=self._odb_logits_kept)

    def floating_point_ops(self, inputs):
        return sum(super(ODBTrainerMixin, self).floating_point_ops(b) for b in micro_batches_of(inputs))

    def _track_num_input_tokens(self, inputs):
        for batch in micro_batches_of(inputs):
            super()._track_num_input_tokens(counted_tokens(batch))

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            logs.update(self._odb_callback.pop_log_metrics())
        return super().log(logs, *args, **kwargs)
