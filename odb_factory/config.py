"""ODBConfig: every knob of the engine, declared once.

Each field carries its documentation and two facts in its metadata (see `option`):
whether every rank must use the same value (the cross-rank agreement check and the resume
check are derived from it) and its LLaMA-Factory YAML key, if it has one. The adapter's
`odb_*` keys, the tables of docs/configuration.md and the checks all read these declarations; a test fails
when a field lacks them.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Tuple

COST_MODES = ("padded", "packed")
OVER_BUDGET_POLICIES = ("singleton", "error")
LOSS_SCALINGS = ("exact", "micro_mean", "standard", "none")
STEP_MODES = ("groups", "samples")
BALANCE_MODES = ("padded", "lpt", "min_move")
START_METHODS = (None, "fork", "spawn", "forkserver")
LF_PREFIX = "odb_"
_NOT_SET = object()


def option(default: Any = _NOT_SET, doc: str = "", *, agree: bool, lf_key: Optional[str] = "",
           lf_source: str = "", lf_default: Any = _NOT_SET, choices: Sequence[Any] = (),
           minimum: Optional[float] = None, default_factory: Any = _NOT_SET) -> Any:
    """Declare one option.

    agree: every rank must use the same value (it changes what is planned or how it is
        counted); checked at the first epoch and on resume.
    lf_key: its LLaMA-Factory key without the `odb_` prefix ("" = the field name; None = not
        a YAML key: the adapter fills it from LLaMA-Factory's own arguments, `lf_source`).
    lf_default: the value the adapter uses when the YAML does not set the key, when it
        differs from the engine default (the reason belongs in `doc`).
    choices / minimum: checked by `ODBConfig.validate`.
    """
    metadata = {"doc": doc, "agree": agree, "lf_key": lf_key, "lf_source": lf_source,
                "choices": tuple(choices), "minimum": minimum}
    if lf_default is not _NOT_SET:
        metadata["lf_default"] = lf_default
    if default_factory is not _NOT_SET:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ODBConfig:
    """Configuration of Online Dynamic Batching (one field per option; see `option`)."""

    step_mode: str = option(
        "groups", "`samples`: every optimizer step trains exactly the fixed-batch run's samples "
        "(the same steps, schedule and loss), packed into as few token-budgeted micro-batches "
        "as the budget allows; `groups`: `gradient_accumulation_steps` budget-filled groups per "
        "optimizer step (the paper's; fewer, larger optimizer steps). With LLaMA-Factory "
        "`samples`: a recipe's learning rate keeps its meaning.", agree=True, choices=STEP_MODES,
        lf_key="step", lf_default="samples")
    standard_batch_size: int = option(
        1, "`samples` mode without a trainer's own sampler: per-rank batch size of the fixed-batch "
        "run whose steps are reproduced.", agree=True, minimum=1, lf_key=None,
        lf_source="`per_device_train_batch_size` (through the Trainer's own sampler)")
    token_budget: int = option(
        4096, "`L_max`: tokens of one group (micro-batch) per rank. A group costs "
        "`n·roundup(max_len)` (padded) or `Σ len` (packed); larger budgets mean fewer, fuller "
        "steps until memory or step time dominates. With LLaMA-Factory, `auto` (the default): "
        "1024 in `odb_step: samples` on CPU, where long packed rows cost more per token once the "
        "ranks run short of memory (docs/padding_free.md) and the budget cannot change the model; "
        "4096 otherwise "
        "(in `groups` mode the budget makes the optimizer steps, so it does not follow the "
        "device). The start-up log says which.", agree=True, minimum=1, lf_default="auto")
    join: bool = option(
        True, "true: every index of every rank's view is trained exactly once per epoch "
        "(drained ranks idle); false: ranks never run dry and the epoch ends after exactly "
        "`quota` samples.", agree=True)
    quota: Optional[int] = option(
        None, "Samples per epoch in non-join mode (none: the dataset size).", agree=True, minimum=1)
    loss_scaling: str = option(
        "exact", "`exact`: the global per-token mean over ranks and the optimizer step (the "
        "paper's); `micro_mean` (`samples` mode): each fixed-batch micro-batch's token mean, "
        "averaged, as LLaMA-Factory computes it for VLMs; `standard` (LLaMA-Factory): whatever "
        "the fixed-batch run computes for this model; `none`: `loss_scale` = 1 (keeps "
        "LLaMA-Factory's dft/eaft/asft losses; `groups` mode only).", agree=True,
        choices=LOSS_SCALINGS, lf_default="standard")
    gradient_accumulation_steps: int = option(
        1, "Micro-steps per optimizer step; the exact loss normalises over the whole window.",
        agree=True, minimum=1, lf_key=None, lf_source="`gradient_accumulation_steps`")
    pad_epoch_to_accumulation: bool = option(
        False, "End every epoch with IDLE steps up to a full accumulation window, for trainers "
        "that step the optimizer every N micro-steps.", agree=True, lf_key=None,
        lf_source="always true (HF steps every N micro-steps)")
    seed: int = option(
        0, "Seed of the per-(seed, epoch) permutation that defines each rank's view.",
        agree=True, lf_key=None, lf_source="`data_seed`, else `seed`")
    shuffle: bool = option(
        True, "Shuffle the views every epoch (false: dataset order).", agree=True, lf_key=None,
        lf_source="always true")
    buffer_size: int = option(
        256, "`B`: samples a rank holds when it forms groups. Larger windows sort better (less "
        "padding) but delay the first step and hold more samples.", agree=True, minimum=1)
    outstanding_depth: int = option(
        16, "`D`: planned steps queued ahead of the trainer, so collation and the next window's "
        "alignment overlap training (`data_wait_s` shows a D too small).", agree=True, minimum=1)
    pad_to_multiple_of: int = option(
        1, "Padding granularity of the padded cost.", agree=True, minimum=1, lf_key=None,
        lf_source="the collator's `pad_to_multiple_of`")
    cost_mode: str = option(
        "padded", "`padded`: `n·roundup(max_len)` (what a padding collator allocates); `packed`: "
        "`Σ len` (padding-free models).", agree=True, choices=COST_MODES)
    max_vision_patches: Optional[int] = option(
        None, "Cap on a group's summed vision patches (none: no cap).", agree=True, minimum=1)
    max_audio_frames: Optional[int] = option(
        None, "Cap on a group's summed valid audio mel frames (100 a second; none: no cap).",
        agree=True, minimum=1)
    over_budget: str = option(
        "singleton", "A sample over budget alone: `singleton` trains it alone (warning + metric), "
        "`error` raises naming it.", agree=True, choices=OVER_BUDGET_POLICIES)
    length_key: str = option(
        "input_ids", "Sample key whose length is the LLM input tokens.", agree=True, lf_key=None,
        lf_source="`input_ids`")
    label_key: Optional[str] = option(
        "labels", "Sample key of the labels (none: every token is supervised).", agree=True,
        lf_key=None, lf_source="`labels`")
    ignore_index: int = option(
        -100, "Label value that is not supervised.", agree=True, lf_key=None, lf_source="-100")
    label_shift: bool = option(
        True, "Count supervised tokens as a shifted causal-LM loss sees them (`labels[1:]`).",
        agree=True, lf_key=None, lf_source="true")
    image_grid_key: str = option(
        "image_grid_thw", "Sample key of the (num_images, 3) patch grid (t, h, w), if present.",
        agree=True, lf_key=None, lf_source="`image_grid_thw`")
    vision_token_ids: Tuple[int, ...] = option(
        doc="Without a grid, vision patches = #(tokens in these ids) × `spatial_merge_size`².",
        agree=True, lf_key=None, lf_source="the model's image and video token ids",
        default_factory=tuple)
    audio_token_ids: Tuple[int, ...] = option(
        doc="Without a feature mask, audio frames = #(tokens in these ids) × 4.",
        agree=True, lf_key=None, lf_source="the model's audio token id", default_factory=tuple)
    spatial_merge_size: int = option(
        2, "Vision patches merged into one LLM token per side.", agree=True, minimum=1,
        lf_key=None, lf_source="the vision config's `spatial_merge_size`")
    balance: bool = option(
        False, "Post-balance every aligned step across ranks (OrchMLLM): samples are re-dealt "
        "before collation so each rank's LLM-stage cost is even, within `token_budget`. With "
        "LLaMA-Factory, `auto` (the default): on in `odb_step: samples` when more than one rank "
        "trains (a step's samples only change ranks: the same model, and the ranks wait less for "
        "the longest), off in `groups` mode; the start-up log says which.",
        agree=True, lf_default="auto")
    global_grouping: bool = option(
        False, "Form each round's groups over every rank's samples (their costs are gathered "
        "anyway): the union sorted and cut into groups of least maximal cost, in the fewest "
        "steps of W groups that hold the round within the budget (a thin round takes fewer "
        "steps), a step's W groups of neighbouring cost, each placed on the rank holding most "
        "of its bytes; samples move before collation. The same samples and loss. `samples` "
        "mode: over each optimizer step's samples (the same optimizer steps, as few "
        "micro-batches as fit).", agree=True)
    balance_mode: str = option(
        "padded", "`padded`: cost `n·g(max len)` (padding collators); `lpt`: `Σ g(len)` "
        "(padding-free); `min_move`: fewest moves within `balance_tolerance`.", agree=True,
        choices=BALANCE_MODES)
    balance_tolerance: float = option(
        0.02, "`min_move`: allowed excess of the slowest rank over the lower bound.",
        agree=True, minimum=0)
    ranks_per_node: Optional[int] = option(
        None, "Node size for placement and traffic accounting (none: torchrun's "
        "`LOCAL_WORLD_SIZE`, else one node).", agree=True, minimum=1, lf_key=None,
        lf_source="torchrun's `LOCAL_WORLD_SIZE`")
    num_workers: int = option(
        0, "DataLoader workers running the dataset's per-sample pipeline and cost. With 0 "
        "workers and 0 collate workers everything runs in the training thread when a step is "
        "asked for, as torch's `num_workers=0` does; any worker moves planning to its own thread, "
        "which prepares steps ahead.", agree=False,
        minimum=0, lf_key=None, lf_source="`dataloader_num_workers`, at least 1")
    num_collate_workers: int = option(
        0, "Processes collating groups in parallel (0: the training thread). With "
        "LLaMA-Factory 1: its collator processes images, which belongs off the training thread.",
        agree=False, minimum=0, lf_key="collate_workers", lf_default=1)
    prefetch_factor: int = option(
        2, "Samples in flight per sample worker, as in torch's DataLoader.", agree=False,
        minimum=1, lf_key=None, lf_source="2")
    sync_timeout_s: float = option(
        1800.0, "Seconds before an alignment exchange fails; the error names rank, epoch and "
        "round.", agree=False, lf_key="sync_timeout")
    multiprocessing_context: Optional[str] = option(
        None, "Start method of the worker processes: `fork`, `spawn`, `forkserver` (none: "
        "torch's default).", agree=False, choices=START_METHODS, lf_key=None,
        lf_source="torch's default")

    def __post_init__(self) -> None:
        self.vision_token_ids = tuple(int(t) for t in self.vision_token_ids)
        self.audio_token_ids = tuple(int(t) for t in self.audio_token_ids)
        self.validate()

    def validate(self) -> None:
        """Type, range and choice of every field, from its declaration."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if not _is_instance(value, hints[f.name]):
                raise ValueError(f"{option_name(f.name)} must be {_type_name(hints[f.name])}, "
                                 f"got {value!r}")
            if meta["choices"] and value not in meta["choices"]:
                raise ValueError(f"{option_name(f.name)} must be one of {list(meta['choices'])}, "
                                 f"got {value!r}")
            low = meta["minimum"]
            if low is not None and value is not None and not value >= low:
                raise ValueError(f"{option_name(f.name)} must be >= {low}, got {value!r}")
        if not self.sync_timeout_s > 0:
            raise ValueError(f"{option_name('sync_timeout_s')} must be > 0 seconds, got "
                             f"{self.sync_timeout_s!r}")
        if self.step_mode == "samples":
            if self.loss_scaling == "none":
                raise ValueError(f"{option_name('loss_scaling')} 'none' cannot keep the fixed-batch "
                                 f"run's loss in {option_name('step_mode')} 'samples'; use 'groups'")
            if not self.join:
                raise ValueError(f"{option_name('join')} false has no meaning with "
                                 f"{option_name('step_mode')} 'samples' (every step trains exactly "
                                 "the fixed-batch run's samples); use step_mode 'groups'")
        elif self.loss_scaling == "micro_mean":
            raise ValueError(f"{option_name('loss_scaling')} 'micro_mean' needs the fixed-batch "
                             f"run's micro-batches: set {option_name('step_mode')} 'samples'")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["vision_token_ids"] = list(self.vision_token_ids)
        out["audio_token_ids"] = list(self.audio_token_ids)
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ODBConfig":
        """Build from a mapping of field names, typed (strings such as "4096" or "false"
        are converted); an unknown key names the closest valid one."""
        return typed_dataclass(cls, values, prefix="")

    def planning_fields(self) -> dict:
        """The options every rank must share (declared with agree=True)."""
        # lists, not tuples: a checkpoint's JSON copy must compare equal to this
        return {f.name: list(value) if isinstance(value, tuple) else value
                for f in dataclasses.fields(self) if f.metadata["agree"]
                for value in (getattr(self, f.name),)}


def option_name(name: str) -> str:
    """How errors name a field: `ODBConfig.token_budget (odb_token_budget)`."""
    meta = {f.name: f.metadata for f in dataclasses.fields(ODBConfig)}.get(name)
    key = lf_key_of(name, meta) if meta is not None else None
    return f"ODBConfig.{name}" + (f" (YAML key {LF_PREFIX}{key})" if key else "")


def lf_key_of(name: str, metadata: Mapping[str, Any]) -> Optional[str]:
    """The YAML key suffix of a field, or None when LLaMA-Factory supplies the value."""
    key = metadata["lf_key"]
    return None if key is None else (key or name)


def lf_keys() -> dict:
    """{YAML key suffix: ODBConfig field} for every field settable from a recipe."""
    out = {}
    for f in dataclasses.fields(ODBConfig):
        key = lf_key_of(f.name, f.metadata)
        if key is not None:
            out[key] = f.name
    return out


def lf_defaults() -> dict:
    """{field: value} where the adapter's default differs from the engine's."""
    return {f.name: f.metadata["lf_default"] for f in dataclasses.fields(ODBConfig)
            if "lf_default" in f.metadata}


class OptionTypeError(ValueError):
    """A configuration value of the wrong type (names the key, the value and the type)."""


def typed_dataclass(cls: type, values: Mapping[str, Any], prefix: str = "",
                    base: Mapping[str, Any] = (), key_of: Optional[Mapping[str, str]] = None):
    """`cls(**base, **values)` with each value converted to its declared type by OmegaConf
    ("4096" -> 4096, "false" -> False); a value that cannot be converted, or an unknown
    field, raises naming the key as the user wrote it (`key_of[field]`, else prefix + field)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            raise ValueError(unknown_key_message(key, known, prefix))
    key_of = key_of or {}
    schema = OmegaConf.structured(cls)
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        try:
            OmegaConf.merge(schema, {key: value})
        except OmegaConfBaseException as exc:
            written = key_of.get(key, prefix + key)
            raise OptionTypeError(f"{written}: {value!r} is not {_type_name(hints[key])} "
                                  f"({str(exc).splitlines()[0]})") from None
    merged = OmegaConf.merge(schema, dict(base), dict(values))
    return OmegaConf.to_object(merged)


def unknown_key_message(key: str, known: Sequence[str], prefix: str) -> str:
    guess = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{guess[0]}'?" if guess else ""
    valid = ", ".join(prefix + k for k in sorted(known))
    return f"unknown ODB option '{prefix}{key}'{hint} Valid options: {valid}"


def _is_instance(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return any(_is_instance(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin in (tuple, list):
        return isinstance(value, origin) and all(_is_instance(v, args[0]) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + " or null"
    if origin in (tuple, list):
        return f"a list of {_type_name(args[0])}"
    return {int: "an integer", float: "a number", bool: "a boolean (true/false)",
            str: "a string"}.get(hint, getattr(hint, "__name__", str(hint)))
