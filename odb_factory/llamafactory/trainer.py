"""The ODB trainer: LLaMA-Factory's SFT trainer with ODB's loader, exact loss and a
sample-driven schedule. `patches/odb_factory_patches/llamafactory_sft_workflow.py` hands it to `run_sft`
only when the run's YAML enables ODB."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..comm.topology import ranks_per_node
from ..loader import ODBDataLoader
from . import state
from .callbacks import ODBCallback, state_path
from .lazy_dataset import LazySupervisedDataset
from .train_loader import LFCollate, TrainLoader

logger = logging.getLogger("odb_factory")


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


class ODBTrainerMixin:
    """Mixed in front of LLaMA-Factory's CustomSeq2SeqTrainer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._odb = state.active()
        self._odb_train_loader: Optional[TrainLoader] = None
        if self._odb.config.loss_scaling == "exact":
            self.compute_loss_func = token_sum_loss
        # ODB resumes its own data position from per-rank state; HF must not re-skip batches.
        self.args.ignore_data_skip = True
        dataset = self.train_dataset
        row_of = dataset.dataset_row if isinstance(dataset, LazySupervisedDataset) else (lambda i: i)
        self._odb_callback = ODBCallback(lambda: self._odb_train_loader, self.args.process_index,
                                         self._odb.adapter.audit_dir, row_of,
                                         max_steps_from_user=self.args.max_steps > 0,
                                         num_train_epochs=self.args.num_train_epochs)
        self.add_callback(self._odb_callback)
        if self._odb.config.balance and "vision" in self._odb.adapter.balance_stages:
            self._odb_balance_vision_stage()

    def _odb_balance_vision_stage(self) -> None:
        """Encoder-stage balancing (docs/encoder_balancing.md) over a group of its own, so its
        exchanges never interleave with DDP's or the loader's on a shared group."""
        import datetime

        import torch.distributed as dist
        model = self.accelerator.unwrap_model(self.model)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type != "qwen3_vl":
            raise ValueError(f"odb_balance_stages: [vision] supports Qwen3-VL models; this model is "
                             f"'{model_type}'. Use odb_balance_stages: [llm]")
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        from odb_factory_patches import transformers_qwen3_vl
        config = self._odb.config
        group = dist.new_group(timeout=datetime.timedelta(seconds=config.sync_timeout_s))
        transformers_qwen3_vl.apply(group=group,
                                    ranks_per_node=ranks_per_node(config.ranks_per_node, dist.get_world_size()),
                                    timeout_s=config.sync_timeout_s)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self):
        if self._odb_train_loader is None:
            self._odb_train_loader = self._build_odb_loader()
        return self._odb_train_loader

    def _build_odb_loader(self) -> TrainLoader:
        args, odb = self.args, self._odb
        model = self.accelerator.unwrap_model(self.model) if self.model is not None else None
        model_config = getattr(model, "config", None)
        vision_ids = [t for t in (getattr(model_config, "image_token_id", None),
                                  getattr(model_config, "video_token_id", None)) if t is not None]
        vision_config = getattr(model_config, "vision_config", None)
        # The engine fields LLaMA-Factory owns (ODBConfig's `lf_source` says where each comes from).
        cfg = dataclasses.replace(
            odb.config,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            pad_epoch_to_accumulation=True,
            # lazy preprocessing belongs in worker processes, not beside the trainer
            num_workers=max(1, args.dataloader_num_workers),
            pad_to_multiple_of=getattr(self.data_collator, "pad_to_multiple_of", None) or 1,
            vision_token_ids=tuple(vision_ids),
            spatial_merge_size=getattr(vision_config, "spatial_merge_size", 2),
            balance=odb.config.balance and "llm" in odb.adapter.balance_stages)
        loader = ODBDataLoader(self.train_dataset, cfg, collate_fn=LFCollate(self.data_collator))
        epoch_samples = cfg.quota if (not cfg.join and cfg.quota) else len(self.train_dataset)
        epochs = args.num_train_epochs if args.max_steps <= 0 else 1
        state.progress.total = int(math.ceil(epoch_samples * epochs))
        return TrainLoader(loader, lambda: getattr(self, "control", None), epoch_samples)

    def set_initial_training_values(self, args, dataloader):
        loader: TrainLoader = dataloader
        bound = loader.steps_upper_bound()
        updates_per_epoch = bound // args.gradient_accumulation_steps
        total_batch = self.get_total_train_batch_size(args)
        examples = len(loader.dataset)
        if args.max_steps > 0:
            max_steps, epochs = args.max_steps, sys.maxsize
            samples = max_steps * total_batch
        else:
            epochs = math.ceil(args.num_train_epochs)
            max_steps = self._odb_estimate_steps(loader, args)
            samples = state.progress.total
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

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs,
                             resume_from_checkpoint, trial):
        epochs_trained, _ = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial)
        if resume_from_checkpoint is None:
            return 0, 0
        path = state_path(resume_from_checkpoint, self.args.process_index)
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing: this checkpoint was not written by an ODB run with the same "
                "world size, so ODB cannot resume its data position")
        saved = json.loads(path.read_text())
        loader = self.get_train_dataloader()
        loader.loader.load_state_dict(saved["loader"])
        loader.epoch_consumed = saved["epoch_consumed"]
        state.progress.consumed, state.progress.total = saved["progress"]
        return saved["loader"]["epoch"], 0

    # ------------------------------------------------------------------ schedule and logs
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.args.max_steps <= 0:
            lambdas = getattr(scheduler, "lr_lambdas", None)
            if lambdas is None:
                logger.warning("ODB: %s is not a LambdaLR; its schedule follows optimizer steps "
                               "(an estimate with variable batches)", type(scheduler).__name__)
            else:
                scheduler.lr_lambdas = [sample_progress_lambda(f, num_training_steps) for f in lambdas]
        return scheduler

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:
            logs.update(self._odb_callback.pop_log_metrics())
        return super().log(logs, *args, **kwargs)
