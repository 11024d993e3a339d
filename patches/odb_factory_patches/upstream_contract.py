"""The upstream contract: every private or otherwise fragile part of torch, transformers and
LLaMA-Factory that odb-factory relies on, in one list (docs/upstream_contract.md).

Each entry names a symbol and what the project expects of it: its parameter names (a
callable), names its code must use (a global it looks up, an attribute it reads or sets),
dataclass fields, a constant's value, or, checked by the tests only, a behaviour probe.

``check()`` returns the violations on the installed packages, one line each with the
installed version, the project file that relies on the symbol and why. Each entry has a
gate, the part of odb-factory that cannot work without it:

* ``odb``: ``odb_factory_patches.apply()`` refuses to patch (odb_* keys then fail with the
  reason, as with an unsupported version);
* ``cpu_resume``: ``apply()`` leaves out the CPU-resume fix (torch_serialization) with a
  warning;
* ``vision``: encoder-stage balancing (odb_factory.encoder_stage's qwen3_vl_patch and qwen2_5_omni_patch,
  applied by the trainer on demand): checked by tests/patches; their ``apply()`` accepts
  transformers 4.57.1–4.57.6 and 5.6.0 only;
* ``diagnostics``: an exchange that times out names the ranks that never entered it (without
  the symbol the error names the rank that noticed only): checked by tests/patches.

``apply()`` runs the static checks of the first two gates (a few milliseconds: every module
involved is already imported by then); ``check(deep=True)`` adds the behaviour probes.

    python -m odb_factory_patches.upstream_contract [--deep] [--table]
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from odb_factory.versions import ENCODER_STAGE_TRANSFORMERS_5, TRANSFORMERS_4_57, TRANSFORMERS_5, version_tuple

GATES = ("odb", "cpu_resume", "vision", "diagnostics")
PACKAGES = ("torch", "accelerate", "transformers", "llamafactory")
_NO_VALUE = object()


@dataclasses.dataclass(frozen=True)
class Entry:
    package: str                  # import name: torch, accelerate, transformers, llamafactory
    target: str                   # "module:qualified.name"
    used_by: str                  # the project file that relies on it
    why: str                      # one line
    params: tuple | None = None   # parameter names; "*args", "**kwargs", "*" before keyword-only
    uses: tuple = ()              # names (globals, attributes, string constants) its code must contain
    fields: tuple = ()            # dataclass fields it must have
    value: Any = _NO_VALUE        # a constant's expected value
    probe: Callable[[], str | None] | None = None  # behaviour check (deep only): None or a violation
    gate: str = "odb"
    versions: tuple = ()          # (lowest, highest) version of `package` it applies to; () = all

    @property
    def symbol(self) -> str:
        return self.target.replace(":", ".")

    def applies(self) -> bool:
        if not self.versions:
            return True
        low, high = (version_tuple(v) for v in self.versions)
        return low <= version_tuple(installed_version(self.package)) <= high


# --------------------------------------------------------------------------- behaviour probes
class _PidDataset:
    """dataset[key] -> (key, pid of the process that served it)."""

    def __getitem__(self, key):
        return key, os.getpid()

    def __len__(self):
        return 1


class _Order:
    """A sampler whose order is set before each epoch, like ODB's ViewSampler/PlanSampler."""

    def __init__(self):
        self.order: list = []

    def __iter__(self):
        return iter(list(self.order))


def _identity(x):
    return x


def _report_start(started, _worker_id):
    started.put(os.getpid())


def _probe_persistent_workers() -> str | None:
    """What ODBDataLoader does: iterate once over an empty sampler to start the persistent
    workers, reuse them for a later epoch whose sampler yields non-int keys, stop them with
    _iterator._shutdown_workers()."""
    import functools
    import multiprocessing
    import queue

    from torch.utils.data import DataLoader

    started = multiprocessing.get_context().Queue()
    order = _Order()
    loader = DataLoader(_PidDataset(), batch_size=None, sampler=order, collate_fn=_identity,
                        num_workers=1, persistent_workers=True,
                        worker_init_fn=functools.partial(_report_start, started))
    try:
        for _ in loader:  # the warm-up loop
            pass
        try:
            pid = started.get(timeout=60)
        except queue.Empty:
            return "iterating over an empty sampler did not start the persistent worker"
        order.order = [("plan", 1)]
        got = list(loader)
        if got != [(("plan", 1), pid)]:
            return (f"the next epoch yielded {got!r}, not its key from the worker the warm-up "
                    f"started (pid {pid})")
    finally:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return f"the worker (pid {pid}) is still running after _iterator._shutdown_workers()"


def _probe_cpu_index_tag() -> str | None:
    """With the fix registered, map_location=torch.device('cpu', 0) loads (the tag 'cpu:0')."""
    import io

    import torch

    from . import torch_serialization
    torch_serialization.apply()
    buf = io.BytesIO()
    torch.save(torch.arange(3), buf)
    buf.seek(0)
    try:
        out = torch.load(buf, map_location=torch.device("cpu", 0), weights_only=True)
    except RuntimeError as exc:
        return f"torch.load(map_location=torch.device('cpu', 0)) fails with the fix registered: {exc}"
    return None if torch.equal(out, torch.arange(3)) else "the loaded tensor differs"


def _plain_lr_lambda(_step):
    return 1.0


def _half_lr_lambda(_step):
    return 0.5


def _probe_lambda_lr() -> str | None:
    """What the ODB trainer's create_scheduler does: replace lr_lambdas with plain functions."""
    import torch

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _plain_lr_lambda)
    scheduler.lr_lambdas = [_half_lr_lambda]
    optimizer.step()
    scheduler.step()
    if optimizer.param_groups[0]["lr"] != 0.5:
        return "LambdaLR.step() did not use the replaced lr_lambdas"
    saved = scheduler.state_dict()["lr_lambdas"]
    return None if saved == [None] else f"a plain-function lr_lambda is saved as {saved!r}, not None"


class _Seen(Exception):
    pass


def _probe_pixel_identity() -> str | None:
    """Qwen3VLModel.forward hands get_image_features (directly, and through
    get_video_features for videos) the very pixel tensor objects it was given."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    class Stub:
        get_video_features = Qwen3VLModel.get_video_features

        def get_input_embeddings(self):
            return lambda ids: torch.zeros(*ids.shape, 4)

        def get_image_features(self, pixel_values, *args, **kwargs):
            raise _Seen(pixel_values)

    ids, grid = torch.zeros(1, 4, dtype=torch.long), torch.tensor([[1, 2, 2]])
    for name, grid_name in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        pixels = torch.zeros(4, 8)
        try:
            # undecorated: 4.57's input-checking decorator reads a config the stub lacks
            inspect.unwrap(Qwen3VLModel.forward)(Stub(), input_ids=ids, **{name: pixels, grid_name: grid})
        except _Seen as seen:
            if seen.args[0] is not pixels:
                return f"forward passes get_image_features a new tensor for {name}, not the one it was given"
            continue
        return f"forward with {name} did not call get_image_features"
    return None


# --------------------------------------------------------------------------- the contract
_LOADER = "odb_factory/loader/loader.py"
_TRAINER = "odb_factory/llamafactory/trainer.py"
_STEP_MODES = "odb_factory/llamafactory/step_modes.py"
_LAZY = "odb_factory/llamafactory/lazy_dataset.py"
_AUDIO = "patches/odb_factory_patches/llamafactory_audio_reading.py"
_QWEN = "odb_factory/encoder_stage/qwen3_vl_patch.py"
_SELF_KW = ("self", "**kwargs")
_TF457 = TRANSFORMERS_4_57
_TF5 = TRANSFORMERS_5
_TF_VISION = ENCODER_STAGE_TRANSFORMERS_5  # with _TF457: the encoder-stage patches' versions
_CONVERTED_COLUMNS = ("_prompt", "_response", "_system", "_tools", "_images", "_videos", "_audios")
_PROCESS_MESSAGES = ("self", "messages", "images", "videos", "audios", "processor")
_QWEN3VL = "transformers.models.qwen3_vl.modeling_qwen3_vl"
_QWEN_FORWARD_WHY = ("wrapped; positional arguments are named from this signature; it must hand "
                     "get_image_features/get_video_features the pixel tensor objects themselves (the "
                     "stash is keyed by id())")
_QWEN_FORWARD_PARAMS = ("self", "input_ids", "attention_mask", "position_ids", "past_key_values",
                        "inputs_embeds", "pixel_values", "pixel_values_videos", "image_grid_thw",
                        "video_grid_thw")  # then 5.6.0: mm_token_type_ids; 4.57: cache_position

_OMNI = "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni"
_OMNI_PATCH = "odb_factory/encoder_stage/qwen2_5_omni_patch.py"
_OMNI_FORWARD_HEAD = ("self", "input_ids", "input_features", "pixel_values", "pixel_values_videos", "image_grid_thw",
                      "video_grid_thw", "attention_mask", "feature_attention_mask", "audio_feature_lengths",
                      "position_ids", "past_key_values", "inputs_embeds", "rope_deltas", "labels", "use_cache")
_OMNI_FORWARD_56 = _OMNI_FORWARD_HEAD + ("use_audio_in_video", "video_second_per_grid", "**kwargs")
_OMNI_FORWARD_457 = _OMNI_FORWARD_HEAD + ("output_attentions", "output_hidden_states", "return_dict",
                                          "use_audio_in_video", "cache_position", "video_second_per_grid", "**kwargs")


def _omni_entries(versions: tuple, forward_params: tuple, feature_tail: tuple) -> list:
    """The Qwen2.5-Omni thinker methods the encoder-stage patch wraps, for one transformers range."""
    thinker = f"{_OMNI}:Qwen2_5OmniThinkerForConditionalGeneration"
    return [
        Entry("transformers", f"{thinker}.forward", _OMNI_PATCH,
              "wrapped; positional arguments are named from this signature; it must hand the feature "
              "methods the tensor objects themselves (the stash is keyed by id())", params=forward_params,
              uses=("get_audio_features", "get_image_features", "get_video_features"), gate="vision",
              versions=versions),
        Entry("transformers", f"{thinker}.get_audio_features", _OMNI_PATCH,
              "replaced: keeps the valid frames of feature_attention_mask and runs self.audio_tower, as the "
              "balancer does", params=("self", "input_features", "feature_attention_mask", "audio_feature_lengths")
              + feature_tail, uses=("audio_tower", "_get_feat_extract_output_lengths"), gate="vision",
              versions=versions),
        Entry("transformers", f"{thinker}.get_image_features", _OMNI_PATCH,
              "replaced: returns the stashed or balanced embeddings; self.visual is the tower",
              params=("self", "pixel_values", "image_grid_thw") + feature_tail, uses=("visual",), gate="vision",
              versions=versions),
        Entry("transformers", f"{thinker}.get_video_features", _OMNI_PATCH,
              "replaced like get_image_features", params=("self", "pixel_values_videos", "video_grid_thw")
              + feature_tail, uses=("visual",), gate="vision", versions=versions),
    ]


CONTRACT: tuple = (
    # ---- torch
    Entry("torch", "torch.utils.data.dataloader:DataLoader.__init__", _LOADER,
          "close() finds the persistent workers in the loader's _iterator",
          uses=("_iterator",)),
    Entry("torch", "torch.utils.data.dataloader:DataLoader.__iter__", _LOADER,
          "one pass over an empty sampler starts the persistent workers; later epochs reuse them "
          "with the sampler's new order", uses=("persistent_workers", "_iterator", "_get_iterator", "_reset"),
          probe=_probe_persistent_workers),
    Entry("torch", "torch.utils.data.dataloader:_MultiProcessingDataLoaderIter._shutdown_workers", _LOADER,
          "close() stops the persistent workers (torch has no public way)", params=("self",)),
    Entry("torch", "torch.distributed.distributed_c10d:_get_default_store", "odb_factory/comm/channel.py",
          "each rank counts the exchanges it entered in the process group's store, so a timeout names "
          "the ranks that never arrived", params=(), gate="diagnostics"),
    Entry("torch", "torch.optim.lr_scheduler:LambdaLR.get_lr", _STEP_MODES,
          "create_scheduler swaps scheduler.lr_lambdas for sample-progress lambdas",
          uses=("lr_lambdas",), probe=_probe_lambda_lr),
    Entry("torch", "torch.optim.lr_scheduler:LambdaLR.state_dict", _STEP_MODES,
          "plain-function lambdas are saved as None (checkpoints load with weights_only=True)",
          uses=("lr_lambdas", "FunctionType")),
    Entry("torch", "torch.serialization:register_package", "patches/odb_factory_patches/torch_serialization.py",
          "registers the deserializer for cpu:<n> location tags",
          params=("priority", "tagger", "deserializer"), gate="cpu_resume"),
    Entry("torch", "torch.serialization:default_restore_location", "patches/odb_factory_patches/torch_serialization.py",
          "tries the registered deserializers in priority order, first non-None wins; "
          "map_location=torch.device('cpu', n) arrives as the tag 'cpu:n'",
          params=("storage", "location"), uses=("_package_registry",), probe=_probe_cpu_index_tag,
          gate="cpu_resume"),
    # ---- transformers Trainer
    # The 5.x loop calls set_initial_training_values and runs each epoch in _run_epoch; 4.57's
    # _inner_training_loop does both inline, with a third parameter and another 7-tuple.
    Entry("transformers", "transformers.trainer:Trainer._inner_training_loop", _TRAINER,
          "the loop calls the hooks the ODB trainer overrides", versions=_TF5,
          uses=("get_train_dataloader", "set_initial_training_values", "_run_epoch", "on_train_begin")),
    Entry("transformers", "transformers.trainer:Trainer.set_initial_training_values", _TRAINER,
          "overridden: epochs and steps from the ODB loader's bound (7-tuple with total_train_batch_size "
          "and steps_in_epoch)", params=("self", "args", "dataloader"), versions=_TF5),
    Entry("transformers", "transformers.trainer:Trainer._run_epoch", "odb_factory/llamafactory/train_loader.py",
          "TrainLoader gets set_epoch and ends the epoch via control.should_epoch_stop; "
          "ignore_data_skip stops HF from skipping batches", versions=_TF5,
          uses=("set_epoch", "get_batch_samples", "should_epoch_stop", "ignore_data_skip")),
    Entry("transformers", "transformers.trainer:Trainer._track_num_input_tokens", _TRAINER,
          "overridden: counts the tokens of each micro-batch of a samples-mode step",
          params=("self", "inputs"), versions=_TF5),
    Entry("transformers", "transformers.trainer:Trainer._inner_training_loop", _TRAINER,
          "the loop calls the hooks the ODB trainer overrides, sets each epoch on the loader, takes "
          "len(loader) as the epoch's bound and ends the epoch on control.should_epoch_stop; "
          "ignore_data_skip stops it from skipping batches", versions=_TF457,
          uses=("get_train_dataloader", "set_initial_training_values", "on_train_begin", "set_epoch",
                "get_batch_samples", "should_epoch_stop", "ignore_data_skip")),
    Entry("transformers", "transformers.trainer:Trainer.set_initial_training_values", _TRAINER,
          "overridden: epochs and steps from the ODB loader's bound (7-tuple with epoch_based and "
          "len_dataloader)", params=("self", "args", "dataloader", "total_train_batch_size"),
          versions=_TF457),
    Entry("transformers", "transformers.trainer_callback:ProgressCallback.on_train_begin", _TRAINER,
          "keeps its training bar, a tqdm of total max_steps, as training_bar; groups mode moves that total "
          "with its step estimate", uses=("training_bar", "max_steps")),
    Entry("transformers", "transformers.trainer:Trainer.train", _TRAINER,
          "overridden to learn the checkpoint a run resumes from (on_train_begin restores ODB's data "
          "position from it)", params=("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
          versions=_TF5),
    Entry("transformers", "transformers.trainer:Trainer.train", _TRAINER,
          "overridden to learn the checkpoint a run resumes from (on_train_begin restores ODB's data "
          "position from it)", params=("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval",
                                       "**kwargs"), versions=_TF457),
    Entry("transformers", "transformers.trainer:Trainer._get_train_sampler", _TRAINER,
          "samples mode: the fixed-batch run's sampler, whose order ODB's optimizer steps reproduce",
          params=("self", "train_dataset")),
    Entry("transformers", "transformers.trainer:Trainer.train", _TRAINER,
          "sets _train_batch_size (the fixed-batch run's per-device batch) before the loop builds "
          "the loader", uses=("_train_batch_size",)),
    Entry("accelerate", "accelerate.accelerator:Accelerator.prepare_data_loader", _TRAINER,
          "registers the loader in _dataloaders; the samples-mode planning aid is taken out again",
          uses=("_dataloaders",)),
    Entry("accelerate", "accelerate.state:GradientState._set_sync_gradients", _TRAINER,
          "samples mode: gradients synchronise (and DeepSpeed steps) on an optimizer step's last "
          "micro-batch only", params=("self", "sync_gradients")),
    Entry("transformers", "transformers.trainer:Trainer.get_batch_samples", _TRAINER,
          "counts the label tokens of an accumulation window (num_items_in_batch) the exact loss divides by",
          params=("self", "epoch_iterator", "num_batches", "device"), uses=("_get_num_items_in_batch",)),
    Entry("transformers", "transformers.trainer:Trainer._get_num_items_in_batch", _TRAINER,
          "counts when compute_loss_func is set (LLaMA-Factory turns model_accepts_loss_kwargs off "
          "for VLMs) and sums over ranks", params=("self", "batch_samples", "device"),
          uses=("compute_loss_func", "model_accepts_loss_kwargs", "average_tokens_across_devices", "gather")),
    Entry("transformers", "transformers.trainer:Trainer.compute_loss", _TRAINER,
          "calls compute_loss_func(outputs, labels, num_items_in_batch=) and multiplies by the world "
          "size, as token_sum_loss expects",
          params=("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
          uses=("compute_loss_func", "num_processes")),
    Entry("transformers", "transformers.trainer:Trainer.create_scheduler", _TRAINER,
          "overridden: the LR schedule follows sample progress",
          params=("self", "num_training_steps", "optimizer")),
    Entry("transformers", "transformers.trainer:Trainer.log", _TRAINER,
          "overridden: adds the odb/* metrics to each loss log", params=("self", "logs", "start_time")),
    Entry("transformers", "transformers.trainer:Trainer.get_total_train_batch_size", _TRAINER,
          "called by set_initial_training_values", params=("self", "args")),
    Entry("transformers", "transformers.trainer:Trainer._maybe_log_save_evaluate",
          "odb_factory/llamafactory/callbacks.py",
          "on_save runs after _save_checkpoint, so the checkpoint directory exists",
          uses=("_save_checkpoint", "on_save")),
    Entry("transformers", "transformers.trainer:Trainer._save_checkpoint", "odb_factory/llamafactory/callbacks.py",
          "writes checkpoint-<global_step>, where on_save puts odb_state_rank<r>.json",
          uses=("PREFIX_CHECKPOINT_DIR",)),
    Entry("transformers", "transformers.trainer_utils:PREFIX_CHECKPOINT_DIR", "odb_factory/llamafactory/callbacks.py",
          "the checkpoint directory name on_save builds", value="checkpoint"),
    Entry("transformers", "transformers.training_args:TrainingArguments", _TRAINER,
          "ignore_data_skip is set; the rest is read", fields=(
              "ignore_data_skip", "average_tokens_across_devices", "data_seed", "dataloader_num_workers")),
    Entry("transformers", "transformers.hf_argparser:HfArgumentParser.parse_dict",
          "odb_factory/llamafactory/arguments.py", "types and validates the odb_* keys",
          params=("self", "args", "allow_extra_keys")),
    # ---- LLaMA-Factory
    Entry("llamafactory", "llamafactory.launcher:launch", "odb_factory_hook.py",
          "the CLI and every torchrun worker import llamafactory.train.tuner (the hook's target)",
          uses=("run_exp",)),
    Entry("llamafactory", "llamafactory.train.tuner:_training_function", "odb_factory_hook.py",
          "parses with get_train_args and trains SFT with run_sft", uses=("get_train_args", "run_sft")),
    Entry("llamafactory", "llamafactory.hparams.parser:_parse_train_args",
          "patches/odb_factory_patches/llamafactory_hparams_parser.py",
          "wrapped to split off and validate the odb_* keys", params=("args",)),
    Entry("llamafactory", "llamafactory.hparams.parser:_parse_train_mca_args",
          "patches/odb_factory_patches/llamafactory_hparams_parser.py",
          "wrapped to refuse odb_* keys under USE_MCA=1", params=("args",)),
    Entry("llamafactory", "llamafactory.hparams.parser:get_train_args",
          "patches/odb_factory_patches/llamafactory_hparams_parser.py",
          "looks _parse_train_args and _parse_train_mca_args up in the module at call time",
          uses=("_parse_train_args", "_parse_train_mca_args")),
    Entry("llamafactory", "llamafactory.data.loader:_get_preprocessed_dataset",
          "patches/odb_factory_patches/llamafactory_data_loader.py",
          "wrapped: the SFT training split becomes a LazySupervisedDataset",
          params=("dataset", "data_args", "training_args", "stage", "template", "tokenizer", "processor",
                  "is_eval")),
    Entry("llamafactory", "llamafactory.data.loader:get_dataset",
          "patches/odb_factory_patches/llamafactory_data_loader.py",
          "looks _get_preprocessed_dataset up in the module at call time", uses=("_get_preprocessed_dataset",)),
    Entry("llamafactory", "llamafactory.data.loader:_get_dataset_processor",
          "patches/odb_factory_patches/llamafactory_data_loader.py",
          "builds the stage's dataset processor (pretrain, supervised, pairwise) the lazy dataset runs per sample",
          params=("data_args", "stage", "template", "tokenizer", "processor", "do_generate")),
    Entry("llamafactory", "llamafactory.data.loader:_get_merged_dataset", "odb_factory/dry_run/pipeline.py",
          "the dry run loads and merges the recipe's data sets as get_dataset does, without preprocessing",
          params=("dataset_names", "model_args", "data_args", "training_args", "stage", "return_dict")),
    Entry("llamafactory", "llamafactory.data.data_utils:split_dataset", "odb_factory/dry_run/pipeline.py",
          "the dry run splits off val_size as get_dataset does",
          params=("dataset", "eval_dataset", "data_args", "seed")),
    Entry("llamafactory", "llamafactory.train.sft.workflow:run_sft",
          "patches/odb_factory_patches/llamafactory_sft_workflow.py",
          "builds its trainer, and counts effective tokens, through the module-level names "
          "CustomSeq2SeqTrainer and calculate_tps the patch replaces",
          uses=("CustomSeq2SeqTrainer", "calculate_tps")),
    Entry("llamafactory", "llamafactory.train.pt.workflow:run_pt",
          "patches/odb_factory_patches/llamafactory_pt_workflow.py",
          "builds its trainer through the module-level name CustomTrainer the patch replaces, with the "
          "finetuning arguments as a keyword", uses=("CustomTrainer", "finetuning_args")),
    Entry("llamafactory", "llamafactory.train.dpo.workflow:run_dpo",
          "patches/odb_factory_patches/llamafactory_dpo_trainer.py",
          "imports CustomDPOTrainer from llamafactory.train.dpo.trainer when it builds the trainer (the name the "
          "patch replaces), with the finetuning arguments as a keyword, and reads its pairs as data stage rm",
          uses=("CustomDPOTrainer", "finetuning_args", "rm")),
    Entry("llamafactory", "llamafactory.train.dpo.trainer:CustomDPOTrainer.get_batch_loss_metrics",
          "odb_factory/llamafactory/pairwise.py",
          "returns the mean of the per-pair losses compute_preference_loss returned (the SFT term added in "
          "place); ODB weighs those per-pair losses instead, and refuses a mean of anything else",
          params=("self", "model", "batch", "train_eval"), uses=("compute_preference_loss", "mean")),
    Entry("llamafactory", "llamafactory.train.dpo.trainer:CustomDPOTrainer.compute_preference_loss",
          "odb_factory/llamafactory/pairwise.py", "returns (per-pair losses, chosen rewards, rejected rewards)",
          params=("self", "policy_chosen_logps", "policy_rejected_logps", "reference_chosen_logps",
                  "reference_rejected_logps")),
    Entry("llamafactory", "llamafactory.data.processor.pairwise:PairwiseDatasetProcessor.preprocess_dataset",
          "odb_factory/llamafactory/lazy_dataset.py",
          "stage dpo: one pair per row (chosen_/rejected_ input_ids and labels), run per sample; the rows it "
          "drops (an even prompt, fewer than two responses) are filtered up front",
          params=("self", "examples"), uses=("chosen_input_ids", "rejected_labels", "_response")),
    Entry("llamafactory", "llamafactory.data.collator:PairwiseDataCollatorWithPadding.__call__",
          "odb_factory/llamafactory/pairwise.py",
          "lays n pairs out as 2n padded rows, chosen then rejected (what PairCost prices)",
          params=("self", "features"), uses=("chosen", "rejected")),
    Entry("llamafactory", "llamafactory.data.processor.pretrain:PretrainDatasetProcessor.preprocess_dataset",
          "odb_factory/llamafactory/lazy_dataset.py",
          "stage pt, packing false: one document per row, so the lazy dataset runs it per sample",
          params=("self", "examples"), uses=("packing", "_prompt")),
    Entry("llamafactory", "llamafactory.extras.misc:calculate_tps",
          "patches/odb_factory_patches/llamafactory_sft_workflow.py",
          "replaced for ODB runs: tokens from the loader's counts, not a pass over the dataset",
          params=("dataset", "metrics", "stage")),
    Entry("llamafactory", "llamafactory.train.sft.trainer:CustomSeq2SeqTrainer.__init__", _TRAINER,
          "ODBTrainerMixin runs after it and sets compute_loss_func to token_sum_loss",
          params=("self", "finetuning_args", "processor", "model_args", "gen_kwargs", "ref_model", "**kwargs"),
          uses=("compute_loss_func", "model_accepts_loss_kwargs")),
    Entry("llamafactory", "llamafactory.train.sft.trainer:CustomSeq2SeqTrainer.create_scheduler", _TRAINER,
          "the ODB trainer's create_scheduler calls it through super()",
          params=("self", "num_training_steps", "optimizer")),
    Entry("llamafactory", "llamafactory.data.converter:AlpacaDatasetConverter.__call__", _LAZY,
          "writes the format-aligned columns the lazy dataset reads", uses=_CONVERTED_COLUMNS),
    Entry("llamafactory", "llamafactory.data.converter:SharegptDatasetConverter.__call__", _LAZY,
          "writes the format-aligned columns the lazy dataset reads", uses=_CONVERTED_COLUMNS),
    Entry("llamafactory", "llamafactory.data.processor.supervised:SupervisedDatasetProcessor.preprocess_dataset",
          _LAZY, "run on a one-row batch per sample; the rows it drops are filtered up front",
          params=("self", "examples"), uses=("_prompt", "_response")),
    Entry("llamafactory", "llamafactory.data.processor.supervised:SupervisedDatasetProcessor.print_data_example",
          "patches/odb_factory_patches/llamafactory_data_loader.py", "prints the first lazy sample",
          params=("self", "example")),
    Entry("llamafactory", "llamafactory.data.processor.processor_utils:DatasetProcessor", _LAZY,
          "the truncation check reads the processor's template, tokenizer, processor and data_args",
          fields=("template", "tokenizer", "processor", "data_args")),
    Entry("llamafactory", "llamafactory.hparams.data_args:DataArguments", _LAZY,
          "cutoff_len for the truncation check; streaming keeps upstream preprocessing",
          fields=("cutoff_len", "streaming")),
    Entry("llamafactory", "llamafactory.data.template:Template", _LAZY,
          "the template's mm_plugin expands vision tokens", fields=("mm_plugin",)),
    Entry("llamafactory", "llamafactory.data.mm_plugin:MMPluginMixin", _LAZY,
          "the placeholder tokens the truncation check counts", fields=("image_token", "video_token")),
    Entry("llamafactory", "llamafactory.data.mm_plugin:BasePlugin.process_messages", _LAZY,
          "re-expands a cut row's vision tokens to count them", params=_PROCESS_MESSAGES),
    Entry("llamafactory", "llamafactory.data.mm_plugin:Qwen2VLPlugin.process_messages", _LAZY,
          "the same call for Qwen2.5-VL", params=_PROCESS_MESSAGES),
    Entry("llamafactory", "llamafactory.data.mm_plugin:Qwen3VLPlugin.process_messages", _LAZY,
          "the same call for Qwen3-VL", params=_PROCESS_MESSAGES),
    Entry("llamafactory", "llamafactory.data.mm_plugin:MMPluginMixin._regularize_audios", _AUDIO,
          "replaced: decodes with soundfile, then PyAV, where upstream's torchaudio.load needs torchcodec and "
          "a system FFmpeg; returns the same audios/sampling_rates dict",
          params=("self", "audios", "sampling_rate", "**kwargs"),
          uses=("torchaudio", "load", "resample", "audios", "sampling_rates")),
    Entry("llamafactory", "llamafactory.data.mm_plugin:Qwen2OmniPlugin._get_mm_inputs", _AUDIO,
          "Qwen2.5-Omni reads its audios through _regularize_audios (the replaced method)",
          uses=("_regularize_audios", "audio_sampling_rate")),
    # ---- Qwen2.5-Omni audio and vision balancing (odb_factory.versions.ENCODER_STAGE_TRANSFORMERS_RANGES)
    *_omni_entries(_TF_VISION, _OMNI_FORWARD_56, ("**kwargs",)),
    *_omni_entries(_TF457, _OMNI_FORWARD_457, ()),
    Entry("transformers", f"{_OMNI}:Qwen2_5OmniAudioEncoder.forward", "odb_factory/encoder_stage/audio.py",
          "the balancer runs the tower on its share as get_audio_features does: (mel, frames), "
          "feature_lens, aftercnn_lens", params=("self", "input_features", "feature_lens", "aftercnn_lens", "**kwargs"),
          uses=("n_window",), gate="vision"),
    # ---- Qwen3-VL vision balancing
    Entry("transformers", f"{_QWEN3VL}:Qwen3VLModel.forward", _QWEN, _QWEN_FORWARD_WHY,
          params=_QWEN_FORWARD_PARAMS + ("mm_token_type_ids", "**kwargs"),
          uses=("get_image_features", "get_video_features"), probe=_probe_pixel_identity, gate="vision",
          versions=_TF_VISION),
    Entry("transformers", f"{_QWEN3VL}:Qwen3VLModel.get_image_features", _QWEN,
          "replaced: returns the stashed or balanced embeddings; self.visual is the tower",
          params=("self", "pixel_values", "image_grid_thw", "**kwargs"), uses=("visual",), gate="vision", versions=_TF_VISION),
    Entry("transformers", f"{_QWEN3VL}:Qwen3VLModel.get_video_features", _QWEN,
          "delegates to get_image_features, so the one replacement covers videos",
          params=("self", "pixel_values_videos", "video_grid_thw", "**kwargs"), uses=("get_image_features",),
          gate="vision", versions=_TF_VISION),
    Entry("transformers", f"{_QWEN3VL}:Qwen3VLModel.forward", _QWEN, _QWEN_FORWARD_WHY,
          params=_QWEN_FORWARD_PARAMS + ("cache_position", "**kwargs"),
          uses=("get_image_features", "get_video_features"), probe=_probe_pixel_identity, gate="vision",
          versions=_TF457),
    Entry("transformers", f"{_QWEN3VL}:Qwen3VLModel.get_image_features", _QWEN,
          "replaced: returns the stashed or balanced (embeddings per item, deepstack) tuple; self.visual "
          "is the tower", params=("self", "pixel_values", "image_grid_thw"), uses=("visual",),
          gate="vision", versions=_TF457),
    Entry("transformers", f"{_QWEN3VL}:Qwen3VLModel.get_video_features", _QWEN,
          "delegates to get_image_features, so the one replacement covers videos",
          params=("self", "pixel_values_videos", "video_grid_thw"), uses=("get_image_features",),
          gate="vision", versions=_TF457),
    Entry("transformers", f"{_QWEN3VL}:Qwen3VLVisionModel.forward", "odb_factory/encoder_stage/vision.py",
          "the balancer runs the tower on its share and reads its (embeddings, deepstack) tuple",
          params=("self", "hidden_states", "grid_thw", "**kwargs"), gate="vision", versions=_TF457),
    Entry("transformers", f"{_QWEN3VL}:BaseModelOutputWithDeepstackFeatures", _QWEN,
          "the output the replacement builds", fields=("last_hidden_state", "pooler_output", "deepstack_features"),
          gate="vision", versions=_TF_VISION),
    Entry("transformers", f"{_QWEN3VL}:Qwen3VLVisionModel.forward", "odb_factory/encoder_stage/vision.py",
          "the balancer runs the tower on its share and reads pooler_output/deepstack_features",
          params=("self", "hidden_states", "grid_thw", "**kwargs"),
          uses=("pooler_output", "deepstack_features"), gate="vision", versions=_TF_VISION),
    Entry("transformers", f"{_QWEN3VL}:Qwen3VLVisionModel.__init__", _QWEN,
          "the replacement splits embeddings per item by the tower's spatial_merge_size",
          uses=("spatial_merge_size",), gate="vision"),
    Entry("transformers", "transformers.models.qwen3_vl.configuration_qwen3_vl:Qwen3VLVisionConfig",
          "odb_factory/encoder_stage/vision.py", "TowerDims.of reads the tower's sizes", fields=(
              "in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size", "out_hidden_size",
              "deepstack_visual_indexes"), gate="vision", versions=_TF_VISION),
    Entry("transformers", "transformers.models.qwen3_vl.configuration_qwen3_vl:Qwen3VLConfig.model_type", _TRAINER,
          "odb_balance_stages: [vision] accepts this model type", value="qwen3_vl", gate="vision"),
)


# --------------------------------------------------------------------------- the checker
def _resolve(target: str) -> Any:
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(_unpatched(obj), part)  # (through a class name our patch replaced)
    return obj


def _ours(obj: Any) -> bool:
    return str(getattr(obj, "__module__", None) or "").startswith("odb_factory_patches")


def _unpatched(obj: Any) -> Any:
    """Our functools.wraps wrappers keep the upstream function as __wrapped__."""
    while _ours(obj) and hasattr(obj, "__wrapped__"):
        obj = obj.__wrapped__
    return obj


def param_names(fn: Callable) -> tuple:
    out: list = []
    star = False
    params = list(inspect.signature(fn).parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name)
            if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
                out.append("/")
    return tuple(out)


def code_words(fn: Callable) -> set:
    """Global/attribute names and string constants in fn's code, nested code included."""
    stack = [inspect.unwrap(fn).__code__]
    words: set = set()
    while stack:
        code = stack.pop()
        words.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, str):
                words.add(const)
            elif isinstance(const, tuple):
                words.update(c for c in const if isinstance(c, str))
            elif inspect.iscode(const):
                stack.append(const)
    return words


def _problems(entry: Entry, deep: bool) -> list:
    try:
        obj = _unpatched(_resolve(entry.target))
    except (ImportError, AttributeError) as exc:
        return [f"is missing ({type(exc).__name__}: {exc})"]
    except Exception as exc:  # a module that fails to import
        return [f"cannot be looked up ({type(exc).__name__}: {exc})"]
    if _ours(obj):
        return ["is replaced by an odb-factory patch here; check the contract before patching"]
    problems = []
    if entry.params is not None:
        try:
            found = param_names(obj)
        except (TypeError, ValueError) as exc:
            found = f"no signature ({exc})"
        if isinstance(found, str):
            problems.append(found)
        elif found != tuple(entry.params):
            problems.append(f"parameters changed: expected ({', '.join(entry.params)}), "
                            f"found ({', '.join(found)})")
    if entry.uses:
        try:
            words = code_words(obj)
        except (AttributeError, TypeError):
            words = set()
        missing = [w for w in entry.uses if w not in words]
        if missing:
            problems.append(f"its code no longer uses {', '.join(missing)}")
    if entry.fields:
        if not dataclasses.is_dataclass(obj):
            problems.append("is no longer a dataclass")
        else:
            names = {f.name for f in dataclasses.fields(obj)}
            missing = [f for f in entry.fields if f not in names]
            if missing:
                problems.append(f"lacks the fields {', '.join(missing)}")
    if entry.value is not _NO_VALUE and obj != entry.value:
        problems.append(f"is {obj!r}, expected {entry.value!r}")
    if deep and entry.probe is not None:
        try:
            result = entry.probe()
        except Exception as exc:  # a probe that breaks is a contract change too
            result = f"probe {entry.probe.__name__} raised {type(exc).__name__}: {exc}"
        if result:
            problems.append(result)
    return problems


def installed_version(package: str) -> str:
    try:
        return str(importlib.import_module(package).__version__)
    except Exception:
        return "(not importable)"


def check(entries: Iterable[Entry] | None = None, *, gates: Sequence[str] = GATES,
          deep: bool = False) -> list:
    """Violations of the contract on the installed packages (empty: it holds). One line per
    broken entry: package and installed version, symbol, what changed, who relies on it."""
    violations = []
    for entry in CONTRACT if entries is None else entries:
        if entry.gate not in gates or not entry.applies():
            continue
        for problem in _problems(entry, deep):
            violations.append(f"{entry.package} {installed_version(entry.package)}: {entry.symbol} {problem} "
                              f"[{entry.used_by}: {entry.why}]")
    return violations


def reason(gates: Sequence[str], entries: Iterable[Entry] | None = None) -> str | None:
    """None when the static checks of `gates` pass, else one message for a log or an error."""
    violations = check(entries, gates=gates)
    if not violations:
        return None
    versions = ", ".join(f"{p} {installed_version(p)}" for p in PACKAGES)
    return (f"the upstream contract (docs/upstream_contract.md) does not hold on {versions}:\n  - "
            + "\n  - ".join(violations))


# --------------------------------------------------------------------------- the docs table
def _expectation(entry: Entry) -> str:
    parts = []
    if entry.params is not None:
        parts.append(f"`({', '.join(entry.params)})`")
    if entry.uses:
        parts.append("uses " + ", ".join(f"`{w}`" for w in entry.uses))
    if entry.fields:
        parts.append("fields " + ", ".join(f"`{f}`" for f in entry.fields))
    if entry.value is not _NO_VALUE:
        parts.append(f"`== {entry.value!r}`")
    if entry.probe is not None:
        parts.append(f"probe `{entry.probe.__name__}`")
    return "; ".join(parts)


def markdown_table() -> str:
    rows = ["| Package | Symbol | Versions | Expected | Used by | Why | Gate |",
            "|---|---|---|---|---|---|---|"]
    for e in CONTRACT:
        versions = "–".join(e.versions) if e.versions else "all"
        rows.append(f"| {e.package} | `{e.symbol}` | {versions} | {_expectation(e)} | `{e.used_by}` | "
                    f"{e.why.replace('|', '/')} | {e.gate} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deep", action="store_true", help="also run the behaviour probes")
    parser.add_argument("--table", action="store_true", help="print the docs table and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table())
        return 0
    violations = check(deep=args.deep)
    for line in violations:
        print(line)
    if not violations:
        print(f"the upstream contract holds ({len(CONTRACT)} entries; "
              + ", ".join(f"{p} {installed_version(p)}" for p in PACKAGES) + ")")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
