"""Read a training recipe the way `llamafactory-cli train` does: the YAML merged with
OmegaConf `key=value` overrides, parsed by LLaMA-Factory's own `get_train_args` with the
odb-factory patches applied (so the `odb_*` keys are typed and checked exactly as in a run)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..config import ODBConfig

# Settings that only say how a run uses its devices. A dry run starts no process group and
# touches no accelerator, and LLaMA-Factory's parser refuses these outside a launched run on
# GPUs (DeepSpeed without torchrun, pure_bf16 without a bf16 GPU), so they are set aside for
# the parse and named in the output.
DEVICE_ONLY_KEYS = {"deepspeed": None, "pure_bf16": False}


class RecipeError(ValueError):
    """A recipe, override or key the dry run cannot use; the message names it."""


@dataclass
class Recipe:
    path: Path
    raw: Dict[str, Any]            # the YAML merged with the overrides
    model_args: Any
    data_args: Any
    training_args: Any
    finetuning_args: Any
    stage: Any                     # stages.Stage: what the recipe's `stage` changes
    odb: Any                       # ODBRunOptions of the recipe (defaults when it has no odb_* key)
    odb_enabled: bool              # the recipe itself turns ODB on
    batch_size: int                # per_device_train_batch_size
    accumulation: int              # the recipe's gradient_accumulation_steps
    set_aside: List[str]           # device-only keys not applied to the dry run

    @property
    def packed_attention(self) -> str:
        """How the run's packed rows would attend: per sample under flash attention or
        `odb_packed_attention: segments`, else through a dense block mask."""
        from ..llamafactory.arguments import flash_attention_requested
        if flash_attention_requested(self.raw):
            return "segments"
        return self.odb.adapter.packed_attention

    def planning_config(self, step_mode: Optional[str] = None) -> ODBConfig:
        """The engine configuration the run's loader would get (the fields LLaMA-Factory owns
        filled in as the trainer fills them); the model-dependent vision fields are added by
        the pipeline once the model config is read."""
        args = self.training_args
        return dataclasses.replace(
            self.odb.config,
            step_mode=step_mode or self.odb.config.step_mode,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            gradient_accumulation_steps=self.accumulation,
            standard_batch_size=self.batch_size,
            pad_epoch_to_accumulation=True,
            # ODB's budget counts the padding the stage's collator adds
            pad_to_multiple_of=self.stage.pad_multiple(args.do_train))


def merged_yaml(path: Path, overrides: Sequence[str]) -> Dict[str, Any]:
    """The recipe with `key=value` overrides applied, as LLaMA-Factory's CLI merges them."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path} does not exist")
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise RecipeError(f"recipe {path}: expected a .yaml, .yml or .json file")
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise RecipeError(f"override {item!r} is not key=value")
    try:
        base = OmegaConf.load(path)
        merged = OmegaConf.merge(base, OmegaConf.from_cli(list(overrides)))
        raw = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise RecipeError(f"recipe {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path} is not a mapping of keys to values")
    return raw


def parse(path: Path, overrides: Sequence[str] = (), on_cpu: bool = False) -> Recipe:
    """Parse `path` with LLaMA-Factory's parser and the odb-factory patches; `on_cpu`: the
    run being priced trains on CPUs (its automatic token budget is the CPU's)."""
    raw = merged_yaml(path, overrides)
    from ..llamafactory import arguments
    from ..llamafactory.run import run_of
    from .stages import stage_of
    try:
        stage = stage_of(raw.get("stage", "sft"))
    except ValueError as exc:
        raise RecipeError(f"recipe {path}: {exc}") from exc
    # The odb_* keys and the paths are checked again by the parser; here they fail in a
    # fraction of a second, before LLaMA-Factory's slow import.
    try:
        options = arguments.parse_odb_arguments(arguments.split_odb_keys(raw)[1])
    except ValueError as exc:
        raise RecipeError(f"recipe {path}: {exc}") from exc
    # what the stage refuses, and packing (stage pt's default otherwise: documents concatenated
    # into blocks), as a run with odb_enable: true refuses them
    problems = arguments.stage_problems(options, stage.name)
    packing = arguments.packing_problem(raw)
    if packing:
        problems.append(packing)
    if problems:
        raise RecipeError(f"recipe {path}: " + "; ".join(problems))
    arguments.check_paths(raw)
    import odb_factory_patches
    from llamafactory.hparams import get_train_args
    odb_factory_patches.apply()
    set_aside = sorted(k for k, v in DEVICE_ONLY_KEYS.items() if raw.get(k) not in (None, v))
    # as a run with odb_enable: true parses it (stage pt: documents stay whole)
    parse_args = arguments.stage_arguments({k: v for k, v in raw.items() if k not in DEVICE_ONLY_KEYS})
    parse_args["use_cpu"] = True  # LLaMA-Factory refuses one process over several GPUs
    parse_args["overwrite_output_dir"] = True  # it writes nothing: an existing output_dir is no concern
    try:
        model_args, data_args, training_args, finetuning_args, _ = get_train_args(parse_args)
    except ValueError as exc:
        raise RecipeError(f"recipe {path}: {exc}") from exc
    run = run_of(data_args, enabled_only=False)
    odb = run.options if run is not None else arguments.parse_odb_arguments({})
    enabled = run is not None and run.enabled
    arguments.settle_stage(odb, raw)  # what the stage decides, as for a run with odb_enable: true
    odb.decide_token_budget(on_cpu=on_cpu)  # the device the step model prices
    # the recipe's accumulation (a samples-mode run hands it to ODB: HF accumulates over 1)
    accumulation = (run.step_mode.engine_accumulation(odb.config, training_args.gradient_accumulation_steps)
                    if enabled else training_args.gradient_accumulation_steps)
    if data_args.streaming:
        raise RecipeError("streaming: the dry run needs a map-style dataset, as ODB does; set streaming: false")
    return Recipe(Path(path), raw, model_args, data_args, training_args, finetuning_args, stage, odb, enabled,
                  training_args.per_device_train_batch_size, accumulation, set_aside)
