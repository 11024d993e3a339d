"""The `odb_*` YAML keys: their own dataclass, parsed next to LLaMA-Factory's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..config import ODBConfig, unknown_key_message

PREFIX = "odb_"
SUPPORTED_STAGES = ("sft",)
BALANCE_STAGES = ("llm", "vision")
BALANCE_MODES = ("lpt", "padded", "min_move")


@dataclass
class ODBArguments:
    """Options of `odb_*` keys (all optional; nothing changes unless odb_enable is true)."""

    odb_enable: bool = field(default=False, metadata={"help": "Turn Online Dynamic Batching on."})
    odb_token_budget: int = field(default=4096, metadata={"help": "L_max: tokens per rank per micro-batch."})
    odb_join: bool = field(default=True, metadata={"help": "true: exact per-index coverage; false: exact sample quota."})
    odb_loss_scaling: str = field(default="exact", metadata={"help": "exact (global label-token mean) or none."})
    odb_buffer_size: int = field(default=256, metadata={"help": "B: samples per grouping window."})
    odb_outstanding_depth: int = field(default=16, metadata={"help": "D: planned steps queued ahead."})
    odb_collate_workers: int = field(default=1, metadata={"help": "Processes collating groups in parallel."})
    odb_lazy_preprocess: bool = field(default=True, metadata={"help": "Template/tokenize/expand per sample in workers."})
    odb_cost_mode: str = field(default="padded", metadata={"help": "padded (n*max_len) or packed (sum len)."})
    odb_max_vision_patches: Optional[int] = field(default=None, metadata={"help": "Cap on a group's vision patches."})
    odb_over_budget: str = field(default="singleton", metadata={"help": "singleton or error."})
    odb_quota: Optional[int] = field(default=None, metadata={"help": "Samples per epoch in non-join mode."})
    odb_sync_timeout: float = field(default=1800.0, metadata={"help": "Seconds before an alignment exchange fails."})
    odb_audit_dir: Optional[str] = field(default=None, metadata={"help": "Write a per-rank JSONL ledger here."})
    odb_balance: bool = field(default=False, metadata={"help": "Post-balance each step across ranks."})
    odb_balance_stages: List[str] = field(default_factory=lambda: ["llm"], metadata={"help": "llm and/or vision."})
    odb_balance_mode: str = field(default="padded", metadata={
        "help": "padded (LLaMA-Factory pads its batches), lpt (padding-free cost) or min_move."})
    odb_balance_tolerance: float = field(default=0.02, metadata={"help": "min_move: allowed excess over the bound."})

    def validate(self) -> None:
        def choice(name, value, options):
            if value not in options:
                raise ValueError(f"{name}: {value!r} is not one of {list(options)}")
        choice("odb_loss_scaling", self.odb_loss_scaling, ("exact", "none"))
        choice("odb_cost_mode", self.odb_cost_mode, ("padded", "packed"))
        choice("odb_over_budget", self.odb_over_budget, ("singleton", "error"))
        choice("odb_balance_mode", self.odb_balance_mode, BALANCE_MODES)
        for stage in self.odb_balance_stages:
            choice("odb_balance_stages", stage, BALANCE_STAGES)
        for name in ("odb_token_budget", "odb_buffer_size", "odb_outstanding_depth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.odb_collate_workers < 0:
            raise ValueError(f"odb_collate_workers must be >= 0, got {self.odb_collate_workers}")
        if self.odb_sync_timeout <= 0:
            raise ValueError(f"odb_sync_timeout must be > 0 seconds, got {self.odb_sync_timeout}")

    def to_config(self, seed: int, gradient_accumulation_steps: int, num_workers: int,
                  vision_token_ids=(), spatial_merge_size: int = 2) -> ODBConfig:
        return ODBConfig(
            token_budget=self.odb_token_budget, join=self.odb_join, quota=self.odb_quota,
            loss_scaling=self.odb_loss_scaling, gradient_accumulation_steps=gradient_accumulation_steps,
            seed=seed, buffer_size=self.odb_buffer_size, outstanding_depth=self.odb_outstanding_depth,
            cost_mode=self.odb_cost_mode, max_vision_patches=self.odb_max_vision_patches,
            over_budget=self.odb_over_budget, vision_token_ids=tuple(vision_token_ids),
            spatial_merge_size=spatial_merge_size, num_workers=num_workers,
            num_collate_workers=self.odb_collate_workers, sync_timeout_s=self.odb_sync_timeout,
            balance=self.odb_balance and "llm" in self.odb_balance_stages,
            balance_mode=self.odb_balance_mode, balance_tolerance=self.odb_balance_tolerance,
            # LLaMA-Factory's collator pads to a multiple of 8 during training.
            pad_to_multiple_of=8)


FIELD_NAMES = [f.name for f in dataclasses.fields(ODBArguments)]


def split_odb_keys(args: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(LLaMA-Factory's keys, our keys). Unknown `odb_*` keys are an error naming the
    closest valid key — never silently ignored."""
    ours = {k: v for k, v in args.items() if k.startswith(PREFIX)}
    rest = {k: v for k, v in args.items() if not k.startswith(PREFIX)}
    for key in ours:
        if key not in FIELD_NAMES:
            raise ValueError(unknown_key_message(key[len(PREFIX):], [n[len(PREFIX):] for n in FIELD_NAMES],
                                                 prefix=PREFIX))
    return rest, ours


def parse_odb_arguments(values: Mapping[str, Any]) -> ODBArguments:
    """Types and validates the `odb_*` keys with HF's argument parser (the same coercion
    LLaMA-Factory applies to its own keys, e.g. for `key=value` command-line overrides)."""
    from transformers import HfArgumentParser
    (parsed,) = HfArgumentParser(ODBArguments).parse_dict(dict(values), allow_extra_keys=False)
    parsed.validate()
    return parsed


def check_compatible(odb: ODBArguments, raw: Mapping[str, Any]) -> None:
    """Reject settings ODB cannot honour, with the reason. Works on the raw YAML keys so it
    runs before LLaMA-Factory builds TrainingArguments (and with it the process group)."""
    stage = raw.get("stage", "sft")
    if stage not in SUPPORTED_STAGES:
        raise ValueError(f"odb_* options apply to stage {list(SUPPORTED_STAGES)}; this run has stage "
                         f"'{stage}'. Remove the odb_* keys or use stage: sft")
    if not odb.odb_enable:
        return
    problems = []
    if raw.get("packing") or raw.get("neat_packing"):
        problems.append("packing/neat_packing: ODB forms token-budgeted groups itself (packing would "
                        "re-batch its groups, and packing has open bugs with Qwen3-VL); set packing: false")
    for loss in ("use_dft_loss", "use_eaft_loss", "use_asft_loss"):
        if raw.get(loss) and odb.odb_loss_scaling == "exact":
            problems.append(f"{loss}: it replaces the loss function ODB uses for the exact global "
                            "token mean; set odb_loss_scaling: none to keep it, or turn it off")
    accelerator_config = raw.get("accelerator_config") or {}
    if isinstance(accelerator_config, Mapping) and accelerator_config.get("dispatch_batches"):
        problems.append("dispatch_batches: true: rank 0 would read and broadcast every batch, but ODB "
                        "batches are formed per rank; set accelerator_config.dispatch_batches: false")
    if raw.get("streaming"):
        problems.append("streaming: ODB needs a map-style dataset (views and resume are by index); "
                        "set streaming: false")
    if raw.get("group_by_length") or raw.get("train_sampling_strategy") == "group_by_length":
        problems.append("group_by_length sampling: ODB already groups by real length; use the "
                        "default train_sampling_strategy")
    if problems:
        raise ValueError("incompatible settings with odb_enable: true:\n  - " + "\n  - ".join(problems))


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
