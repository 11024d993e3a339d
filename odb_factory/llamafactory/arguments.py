"""The `odb_*` YAML keys: engine options come from `ODBConfig`'s declarations (its
`lf_key` metadata); only what exists in the LLaMA-Factory adapter alone is declared here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..config import LF_PREFIX, ODBConfig, OptionTypeError, lf_defaults, lf_keys, option, typed_dataclass, unknown_key_message
from ..versions import ENCODER_STAGE_TRANSFORMERS_RANGES, FLASH_ATTENTION_BROKEN, describe, encoder_stage_supported
from .padding_free import padding_free_refusal
from .step_modes import step_mode

SUPPORTED_STAGES = ("sft", "pt", "dpo")
# LLaMA-Factory's data stage of each training stage (dpo reads the pairs of data stage rm)
DATA_STAGES = MappingProxyType({"sft": "sft", "pt": "pt", "dpo": "rm"})
# stages whose samples are chosen/rejected pairs, laid out as two padded rows each
PAIRWISE_STAGES = ("dpo",)
AUTO = "auto"
PADDING_FREE_CHOICES = (AUTO, "true", "false")
PACKED_ATTENTIONS = ("segments", "mask")
BALANCE_STAGES = ("llm", "vision", "audio")


@dataclass
class AdapterOptions:
    """Options of the LLaMA-Factory adapter itself (YAML key = `odb_` + field name)."""

    enable: bool = option(False, "Turn Online Dynamic Batching on (stages `sft`, `pt` and `dpo`).", agree=False)
    lazy_preprocess: bool = option(
        True, "Run LLaMA-Factory's template, tokenisation and vision-token expansion per sample "
        "in the DataLoader workers instead of an upfront `datasets.map`.", agree=False)
    supervised_logits: bool = option(
        True, "In training, the model computes logits only at positions whose next token is "
        "supervised (`logits_to_keep`), not at prompt, image or padding positions, whose loss "
        "terms are zero: the same loss and gradients with less of the LM head's work and memory "
        "(`odb_step: samples`, and `groups` with the window's token-sum loss). Models whose "
        "forward takes no `logits_to_keep` compute them all.", agree=False)
    audit_dir: Optional[str] = option(
        None, "Write a per-rank JSONL ledger here (one line per optimizer step).", agree=False)
    padding_free: str = option(
        "auto", "`true`: train each group as one flattened row without padding (real tokens only; "
        "position ids restart per sample; attention per sample: flash varlen, else one causal sdpa "
        "call per sample, see `odb_packed_attention`). Sets `odb_cost_mode: packed` and "
        "`odb_balance_mode: lpt`. Qwen3-VL, Qwen2.5-VL, Qwen3, Llama. `auto`: padding-free where "
        "it pays (those models, per-sample attention, no encoder-stage balancing, no padded cost "
        "keys set), padded groups otherwise; the start-up log says which and why. `false`: padded "
        "groups.", agree=True, choices=PADDING_FREE_CHOICES)
    packed_attention: str = option(
        "segments", "Attention of a padding-free row where the model does not run flash attention "
        "(whose varlen kernels are always used): `segments`, one causal sdpa call per sample (Σ len² "
        "work, no mask); `mask`, transformers' dense (Σ len)² block-causal mask (sdpa/eager).",
        agree=True, choices=PACKED_ATTENTIONS)
    padding_free_row_tokens: Optional[int] = option(
        None, "With `odb_padding_free`: cut a group into rows of at most this many tokens (each "
        "sample whole; shorter rows completed by padding of their own), so `odb_packed_attention: "
        "mask` builds one (row length)² mask per row instead of one (Σ len)² mask. None: one row "
        "per group.", agree=True, minimum=1)
    balance_stages: List[str] = option(
        doc="With `odb_balance`: `llm` (sample exchange in the loader), `vision` (encoder stage, "
        "Qwen3-VL and Qwen2.5-Omni) and/or `audio` (audio encoder stage, Qwen2.5-Omni).",
        agree=True, choices=BALANCE_STAGES, default_factory=lambda: ["llm"])

    def __post_init__(self) -> None:
        # YAML's true/false arrive as the strings "True"/"False"
        self.padding_free = str(self.padding_free).lower()
        for key, value, allowed in (("padding_free", self.padding_free, PADDING_FREE_CHOICES),
                                    ("packed_attention", self.packed_attention, PACKED_ATTENTIONS)):
            if value not in allowed:
                raise ValueError(f"odb_{key}: {value!r} is not one of {list(allowed)}")
        for stage in self.balance_stages:
            if stage not in BALANCE_STAGES:
                raise ValueError(f"odb_balance_stages: {stage!r} is not one of {list(BALANCE_STAGES)}")
        if self.padding_free_row_tokens is not None:
            if self.padding_free_row_tokens < 1:
                raise ValueError(f"odb_padding_free_row_tokens: {self.padding_free_row_tokens} is below 1")
            if self.padding_free == "false":
                raise ValueError("odb_padding_free_row_tokens applies to padding-free groups; set "
                                 "odb_padding_free: true or remove it")


ADAPTER_KEYS = tuple(f.name for f in dataclasses.fields(AdapterOptions))


@dataclass
class ODBRunOptions:
    """What a run's `odb_*` keys say: the adapter's options and the engine configuration
    (LLaMA-Factory-supplied fields such as the seed are filled in by the trainer)."""

    adapter: AdapterOptions
    config: ODBConfig
    vision_stage: bool = False     # balance the vision encoder stage inside the model
    audio_stage: bool = False      # balance the audio encoder stage inside the model
    # `odb_padding_free` decided (None: `auto`, until the model is known) and why
    padding_free: Optional[bool] = None
    padding_free_reason: str = ""
    # `odb_token_budget: auto` waiting for the device (config.token_budget holds the engine's
    # default until then), and why the value it settled on
    token_budget_auto: bool = False
    token_budget_reason: str = ""
    # `odb_balance: auto` waiting for the world size (config.balance is False until then), and why
    # the value it settled on
    balance_auto: bool = False
    balance_reason: str = ""

    def decide_token_budget(self, on_cpu: bool) -> int:
        """Settle `odb_token_budget: auto` for a run on CPU or an accelerator, as the step mode
        says (once; an explicit value stands)."""
        if self.token_budget_auto:
            budget, self.token_budget_reason = step_mode(self.config.step_mode).auto_token_budget(
                on_cpu, self.config.token_budget)
            self.config = dataclasses.replace(self.config, token_budget=budget)
            self.token_budget_auto = False
        return self.config.token_budget

    def decide_balance(self, world_size: int) -> bool:
        """Settle `odb_balance: auto` for `world_size` ranks, as the step mode says (once; an
        explicit value stands). `auto` turns on the LLM stage only, where `odb_balance_stages`
        holds it."""
        if self.balance_auto:
            on, self.balance_reason = step_mode(self.config.step_mode).auto_balance(world_size)
            if on and "llm" not in self.adapter.balance_stages:
                on, self.balance_reason = False, "odb_balance: auto, odb_balance_stages leaves out llm"
            self.config = dataclasses.replace(self.config, balance=on)
            self.balance_auto = False
        return self.config.balance

    def decide_padding_free(self, model_type: Optional[str], flash_attention: bool) -> bool:
        """Settle `odb_padding_free: auto` for a model of this type (once; an explicit value or
        an earlier decision stands); a padding-free run gets the costs it implies."""
        if self.padding_free is None:
            refusal = padding_free_refusal(model_type)
            if refusal is not None:
                self._set_padding_free(False, f"model type '{model_type}' is not verified for packed rows")
            elif self.adapter.packed_attention == "mask" and not flash_attention:
                self._set_padding_free(False, "odb_packed_attention: mask without flash attention builds a "
                                       "dense (Σ len)² mask per row, which can cost more than the padding")
            else:
                self._set_padding_free(True, f"model type '{model_type}' trains packed rows with per-sample "
                                       "attention, so a group costs its real tokens")
        return bool(self.padding_free)

    def _set_padding_free(self, on: bool, reason: str) -> None:
        self.padding_free, self.padding_free_reason = on, reason
        if on:
            # packed groups balance by LPT or min-move; any other mode becomes LPT
            balance_mode = "min_move" if self.config.balance_mode == "min_move" else "lpt"
            self.config = dataclasses.replace(self.config, cost_mode="packed", balance_mode=balance_mode)

    def value_of(self, key: str) -> Any:
        """The parsed value of YAML key `key` (e.g. "odb_token_budget")."""
        name = key[len(LF_PREFIX):]
        if name == "padding_free":  # typed as a string (auto/true/false); YAML writes the booleans
            return {"true": True, "false": False}.get(self.adapter.padding_free, self.adapter.padding_free)
        if name in ADAPTER_KEYS:
            return getattr(self.adapter, name)
        if name == "balance":
            if self.balance_auto:
                return AUTO
            return self.config.balance or self.vision_stage or self.audio_stage
        if name == "token_budget" and self.token_budget_auto:
            return AUTO
        return getattr(self.config, lf_keys()[name])


def all_keys() -> List[str]:
    """Every valid `odb_*` key."""
    return [LF_PREFIX + k for k in list(ADAPTER_KEYS) + list(lf_keys())]


def split_odb_keys(args: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(LLaMA-Factory's keys, our keys). Unknown `odb_*` keys are an error naming the
    closest valid key — never silently ignored."""
    ours = {k: v for k, v in args.items() if k.startswith(LF_PREFIX)}
    rest = {k: v for k, v in args.items() if not k.startswith(LF_PREFIX)}
    valid = [k[len(LF_PREFIX):] for k in all_keys()]
    for key in ours:
        if key[len(LF_PREFIX):] not in valid:
            raise ValueError(unknown_key_message(key[len(LF_PREFIX):], valid, prefix=LF_PREFIX))
    return rest, ours


def parse_odb_arguments(values: Mapping[str, Any]) -> ODBRunOptions:
    """Type and validate the `odb_*` keys (strings from YAML or `key=value` overrides are
    converted to the declared type; a value that cannot be is an error naming the key)."""
    adapter_values, engine_values = {}, {}
    by_key = lf_keys()
    for key, value in values.items():
        name = key[len(LF_PREFIX):]
        if name in ADAPTER_KEYS:
            adapter_values[name] = value
        else:
            engine_values[by_key[name]] = value
    adapter = typed_dataclass(AdapterOptions, adapter_values, prefix=LF_PREFIX)
    key_of = {field: LF_PREFIX + key for key, field in by_key.items()}
    # odb_balance turns balancing on; the stages say where: the loader's sample exchange
    # (the engine's `balance`) for `llm`, the model's encoder for `vision`.
    base = dict(lf_defaults())
    balance = engine_values.pop("balance", base.pop("balance"))
    balance_auto = str(balance).strip().lower() == AUTO  # decided with the world size (decide_balance)
    try:
        requested = not balance_auto and typed_dataclass(ODBConfig, {"balance": balance}, key_of=key_of).balance
    except OptionTypeError as exc:  # the adapter's third value
        raise OptionTypeError(f"{exc}, or auto (the default)") from None
    engine_values["balance"] = requested and "llm" in adapter.balance_stages
    if adapter.padding_free == "true":
        engine_values = padding_free_costs(engine_values)
    # `auto` is the adapter's; the engine gets its own default until the device decides
    budget_auto = str(engine_values.get("token_budget", base.pop("token_budget"))).strip().lower() == AUTO
    if budget_auto:
        engine_values.pop("token_budget", None)
    config = typed_dataclass(ODBConfig, engine_values, base=base, key_of=key_of)
    odb = ODBRunOptions(adapter, config, vision_stage=requested and "vision" in adapter.balance_stages,
                        audio_stage=requested and "audio" in adapter.balance_stages, token_budget_auto=budget_auto,
                        balance_auto=balance_auto)
    decided = auto_padding_free_without_model(odb, engine_values)
    if decided is not None:
        odb.padding_free, odb.padding_free_reason = decided
    return odb


def auto_padding_free_without_model(odb: ODBRunOptions, engine_values: Mapping[str, Any]):
    """(padding-free, why) when the keys alone decide `odb_padding_free`; None when `auto`
    waits for the model type."""
    if odb.adapter.padding_free != "auto":
        return odb.adapter.padding_free == "true", f"odb_padding_free: {odb.adapter.padding_free}"
    for name, (_, allowed) in PADDING_FREE_COSTS.items():
        if name in engine_values and str(engine_values[name]) not in allowed:
            return False, f"odb_{name}: {engine_values[name]} asks for padded groups"
    if odb.vision_stage or odb.audio_stage:
        return False, "encoder-stage balancing (odb_balance_stages) runs on padded groups"
    return None


# what a padding-free group costs: its real tokens (grouping) and Σ a·len + b·len² (balancing)
PADDING_FREE_COSTS = MappingProxyType({"cost_mode": ("packed", ("packed",)),
                                       "balance_mode": ("lpt", ("lpt", "min_move"))})


def padding_free_costs(engine_values: Mapping[str, Any]) -> Dict[str, Any]:
    """The cost settings `odb_padding_free: true` implies; a recipe that sets them otherwise
    is an error naming both keys."""
    values = dict(engine_values)
    for name, (implied, allowed) in PADDING_FREE_COSTS.items():
        if name in values and str(values[name]) not in allowed:
            raise ValueError(f"odb_{name}: {values[name]} contradicts odb_padding_free: true (a padding-free "
                             f"group costs its real tokens); remove odb_{name} or set it to {implied}")
        values.setdefault(name, implied)
    return values


def stage_arguments(raw: Mapping[str, Any]) -> Dict[str, Any]:
    """Stage pt: LLaMA-Factory concatenates the documents into cutoff_len blocks unless
    `packing` is set (every block then costs the same, nothing to batch dynamically); with ODB
    each document is a sample of its own length, so an unset `packing` becomes false."""
    if raw.get("stage") == "pt" and raw.get("packing") is None:
        return dict(raw, packing=False)
    return dict(raw)


def settle_stage(odb: ODBRunOptions, raw: Mapping[str, Any]) -> None:
    """What the stage decides: stage dpo's pairs train in padded rows (LLaMA-Factory's pairwise
    collator and DPO loss read a batch as its chosen rows, then its rejected rows)."""
    if raw.get("stage") in PAIRWISE_STAGES:  # unset: LLaMA-Factory's sft
        if odb.padding_free is None:
            odb.padding_free = False
            odb.padding_free_reason = (f"stage {raw['stage']}: a batch is its chosen rows, then its rejected "
                                       "rows, one per pair")


def stage_step_refusal(stage: str, mode: str) -> Optional[str]:
    """Why stage `stage` cannot train in `odb_step: mode` (None: it can)."""
    refusal = step_mode(mode).pairs_refusal() if stage in PAIRWISE_STAGES else None
    if refusal is None:
        return None
    return f"odb_step: {mode}: stage {stage} trains the fixed-batch run's steps (odb_step: samples); {refusal}"


def stage_padding_free_refusal(stage: str) -> Optional[str]:
    """Why stage `stage` cannot train padding-free rows (None: it can)."""
    if stage not in PAIRWISE_STAGES:
        return None
    return (f"odb_padding_free: true: stage {stage} reads a batch as its chosen rows, then its rejected rows; "
            "set odb_padding_free: auto or false")


def stage_problems(odb: ODBRunOptions, stage: str) -> List[str]:
    """What stage `stage` rules out of these options (the dry run asks it of a recipe that
    does not turn ODB on, as the run would with odb_enable: true)."""
    padding_free = stage_padding_free_refusal(stage) if odb.adapter.padding_free == "true" else None
    return [p for p in (stage_step_refusal(stage, odb.config.step_mode), padding_free) if p is not None]


def packing_problem(raw: Mapping[str, Any]) -> Optional[str]:
    """Why the recipe's packing cannot run with ODB (None: it does not pack)."""
    if not (raw.get("packing") or raw.get("neat_packing")):
        return None
    return ("packing/neat_packing: ODB forms token-budgeted groups itself (packing would re-batch its groups, "
            "and packing has open bugs with Qwen3-VL); set packing: false, and odb_padding_free: true to "
            "train each group without padding")


def check_compatible(odb: ODBRunOptions, raw: Mapping[str, Any]) -> None:
    """Reject settings ODB cannot honour, with the reason. Works on the raw YAML keys so it
    runs before LLaMA-Factory builds TrainingArguments (and with it the process group)."""
    if not odb.adapter.enable:
        return
    stage = raw.get("stage", "sft")
    if stage not in SUPPORTED_STAGES:
        raise ValueError(f"odb_enable: true applies to stage {list(SUPPORTED_STAGES)}; this run has stage "
                         f"'{stage}'. Set odb_enable: false (or remove the odb_* keys), or use stage: sft, pt "
                         "or dpo")
    problems = stage_problems(odb, stage)
    packing = packing_problem(raw)
    if packing:
        problems.append(packing)
    for loss in ("use_dft_loss", "use_eaft_loss", "use_asft_loss"):
        if raw.get(loss) and odb.config.loss_scaling != "none":
            problems.append(f"{loss}: it replaces the loss function ODB weights to reproduce the "
                            "fixed-batch loss; set odb_step: groups and odb_loss_scaling: none to keep "
                            "it, or turn it off")
    accelerator_config = raw.get("accelerator_config") or {}
    if isinstance(accelerator_config, Mapping) and accelerator_config.get("dispatch_batches"):
        problems.append("dispatch_batches: true: rank 0 would read and broadcast every batch, but ODB "
                        "batches are formed per rank; set accelerator_config.dispatch_batches: false")
    if raw.get("streaming"):
        problems.append("streaming: ODB needs a map-style dataset (views and resume are by index); "
                        "set streaming: false")
    # (Megatron-Core, USE_MCA=1, parses its arguments elsewhere: the parser patch refuses it)
    for key, name in {"use_hyper_parallel": "hyper-parallel", "use_kt": "KTransformers"}.items():
        if raw.get(key):
            problems.append(f"{key}: {name} training runs its own trainer and data path, which ODB "
                            f"does not hook; remove the odb_* keys or turn {key} off")
    if raw.get("tokenized_path"):
        problems.append("tokenized_path: LLaMA-Factory would tokenize the whole dataset up front and "
                        "save it, while ODB processes each sample lazily in its DataLoader workers; "
                        "remove tokenized_path")
    if raw.get("group_by_length") or raw.get("train_sampling_strategy") == "group_by_length":
        problems.append("group_by_length sampling: ODB already groups by real length; use the "
                        "default train_sampling_strategy")
    problems += version_problems(odb, raw, _transformers_version())
    if problems:
        raise ValueError("incompatible settings with odb_enable: true:\n  - " + "\n  - ".join(problems))


def flash_attention_requested(raw: Mapping[str, Any]) -> bool:
    """Whether the recipe asks for flash attention (`flash_attn: fa2` or `fa3`; unset is
    LLaMA-Factory's auto, which does not)."""
    return raw.get("flash_attn") in ("fa2", "fa3")


def _transformers_version() -> str:
    import transformers
    return transformers.__version__


def version_problems(odb: ODBRunOptions, raw: Mapping[str, Any], transformers_version: str) -> List[str]:
    """What the installed transformers rules out for this run."""
    problems = []
    if flash_attention_requested(raw) and transformers_version in FLASH_ATTENTION_BROKEN:
        problems.append(f"flash_attn: {raw['flash_attn']}: transformers {transformers_version}'s flash "
                        "attention fails on the first forward (flash_attention_forward calls "
                        "s_aux.to() with s_aux None; 5.6.1 and later guard it, but LLaMA-Factory 0.9.5 "
                        "accepts transformers up to 5.6.0); use flash_attn: sdpa (padding-free rows then "
                        "attend per sample through sdpa), or transformers 4.57.6")
    written_for = describe(ENCODER_STAGE_TRANSFORMERS_RANGES)
    if odb.vision_stage and not encoder_stage_supported(transformers_version):
        problems.append(f"odb_balance_stages: [vision] runs inside the model's forward as transformers "
                        f"{written_for} write it; transformers {transformers_version} is "
                        "installed. Use odb_balance_stages: [llm]")
    if odb.audio_stage and not encoder_stage_supported(transformers_version):
        problems.append(f"odb_balance_stages: [audio] runs inside Qwen2.5-Omni's thinker as transformers "
                        f"{written_for} write it; transformers {transformers_version} is "
                        "installed. Remove audio from odb_balance_stages")
    if raw.get("include_tokens_per_second") and transformers_version.startswith("4."):
        problems.append("include_tokens_per_second: transformers 4.x counts the tokens by iterating the "
                        "training loader once before training (a whole extra epoch of ODB's lazy "
                        "pipeline, on every rank); use include_effective_tokens_per_second")
    return problems


VISION_STAGE_MODEL_TYPES = ("qwen3_vl", "qwen2_5_omni", "qwen2_5_omni_thinker")


def vision_stage_refusal(model_type: Optional[str]) -> Optional[str]:
    """Why `odb_balance_stages: [vision]` cannot run on a model of this type (None: it can)."""
    if model_type in VISION_STAGE_MODEL_TYPES:
        return None
    return (f"odb_balance_stages: [vision] supports Qwen3-VL and Qwen2.5-Omni models; this model is '{model_type}'. "
            "Use odb_balance_stages: [llm]")


AUDIO_STAGE_MODEL_TYPES = ("qwen2_5_omni", "qwen2_5_omni_thinker")


def audio_stage_refusal(model_type: Optional[str]) -> Optional[str]:
    """Why `odb_balance_stages: [audio]` cannot run on a model of this type (None: it can)."""
    if model_type in AUDIO_STAGE_MODEL_TYPES:
        return None
    if model_type is not None and model_type.startswith("qwen3_omni"):
        return ("odb_balance_stages: [audio]: Qwen3-Omni's audio tower attends across the clips of "
                "one call under sdpa (it builds no mask between them), so encoding a clip beside "
                "other ranks' clips would change its embeddings. Remove audio from "
                "odb_balance_stages")
    return (f"odb_balance_stages: [audio] supports Qwen2.5-Omni models; this model is "
            f"'{model_type}'. Remove audio from odb_balance_stages")


def check_model(odb: ODBRunOptions, raw: Mapping[str, Any]) -> None:
    """What the model's own config.json rules out, read at parse time when the model is a
    local folder (a hub id is checked once the model is loaded)."""
    import json
    import os
    from pathlib import Path
    config = Path(str(raw.get("model_name_or_path", ""))).expanduser() / "config.json"
    if not config.is_file():
        return
    model_type = json.loads(config.read_text()).get("model_type")
    # torchrun sets WORLD_SIZE in the workers, where the arguments are parsed
    reasons = [model_refusal(odb, model_type),
               *ddp_unused_parameter_problems(raw, model_type, int(os.environ.get("WORLD_SIZE", "1")))]
    reasons = [r for r in reasons if r]
    if reasons:
        raise ValueError("\n".join(reasons))
    odb.decide_padding_free(model_type, flash_attention=flash_attention_requested(raw))


# Qwen2.5-Omni's audio tower holds an embedding (audio_bos_eos_token) that no forward uses: with the
# tower trainable, DDP waits for its gradient and the second step fails.
UNUSED_PARAMETER_MODEL_TYPES = ("qwen2_5_omni", "qwen2_5_omni_thinker")


def ddp_unused_parameter_problems(raw: Mapping[str, Any], model_type: Optional[str],
                                  world_size: int) -> List[str]:
    """A multi-process DDP run that trains a parameter no forward uses fails at its second step
    (or, looking for unused parameters under reentrant checkpointing, at its first backward):
    named here, with the settings that avoid it."""
    if (model_type not in UNUSED_PARAMETER_MODEL_TYPES or world_size < 2 or raw.get("deepspeed")
            or raw.get("fsdp") or raw.get("finetuning_type") != "full"  # unset: LLaMA-Factory's lora
            or raw.get("freeze_vision_tower", True)):
        return []
    checkpointing = not raw.get("disable_gradient_checkpointing")
    find_unused = raw.get("ddp_find_unused_parameters")
    if find_unused is None:  # transformers' Trainer looks for them unless checkpointing
        find_unused = not checkpointing
    if not find_unused:
        return [f"freeze_vision_tower: false trains the audio tower of this {model_type} model, whose "
                "audio_bos_eos_token no forward uses, so DDP would stop at the second step (\"Expected to "
                "have finished reduction in the prior iteration\"); set ddp_find_unused_parameters: true "
                "(with use_reentrant_gc: false), or keep freeze_vision_tower: true (it freezes the vision "
                "and the audio tower)"]
    if checkpointing and raw.get("use_reentrant_gc", True):
        return ["ddp_find_unused_parameters: true with reentrant gradient checkpointing (use_reentrant_gc: "
                "true, LLaMA-Factory's default) fails on the first backward (\"Expected to mark a variable "
                "ready only once\"); set use_reentrant_gc: false, or disable_gradient_checkpointing: true"]
    return []


def model_refusal(odb: ODBRunOptions, model_type: Optional[str]) -> Optional[str]:
    """Why this run's ODB options cannot train a model of this type (None: they can)."""
    reasons = [vision_stage_refusal(model_type) if odb.vision_stage else None,
               audio_stage_refusal(model_type) if odb.audio_stage else None,
               padding_free_refusal(model_type) if odb.adapter.padding_free == "true" else None]
    reasons = [r for r in reasons if r is not None]
    return "\n".join(reasons) if reasons else None


def check_paths(raw: Mapping[str, Any]) -> None:
    """Missing local model or data paths, named before any process starts training."""
    from pathlib import Path
    model = raw.get("model_name_or_path")
    if isinstance(model, str) and (model.startswith((".", "/", "~")) or Path(model).exists()):
        if not Path(model).expanduser().exists():
            raise FileNotFoundError(f"model_name_or_path: {model} does not exist")
    dataset_dir = raw.get("dataset_dir")
    if isinstance(dataset_dir, str) and dataset_dir not in ("ONLINE",):
        info = Path(dataset_dir) / "dataset_info.json"
        if not Path(dataset_dir).is_dir():
            raise FileNotFoundError(f"dataset_dir: {dataset_dir} is not a directory")
        if raw.get("dataset") and info.exists():
            import json
            known = json.loads(info.read_text())
            names = [n.strip() for n in str(raw["dataset"]).split(",")]
            missing = [n for n in names if n not in known]
            if missing:
                raise ValueError(f"dataset {missing} not registered in {info} (known: {sorted(known)})")
