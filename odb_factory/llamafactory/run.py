"""`ODBRun`: one training run with ODB, the value the adapter's parts receive.

The parser patch builds it from the run's `odb_*` keys and hands it on with LLaMA-Factory's
own argument objects (`attach`); the data-loader patch, the trainer, its callback and loader,
and the dry run read it from there (`run_of`). Nothing about a run lives in a module, so two
runs in one process (a sweep, a notebook, the dry run beside a test) never see each other's
options or progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .arguments import ODBRunOptions
from .step_modes import StepMode, step_mode

# the attribute of LLaMA-Factory's DataArguments and FinetuningArguments that carries the run:
# not a dataclass field, so their dicts, prints and TrainingArguments' pickle never show it
ATTRIBUTE = "odb_run"


@dataclass
class SampleProgress:
    """Fraction of all samples of the run trained so far (all ranks, all epochs)."""
    consumed: int = 0
    total: int = 0
    input_tokens: int = 0   # LLM input tokens this rank trained in this run (not IDLE fillers)

    def start(self, total: int) -> None:
        """The run's sample count is known (the trainer built its loader); a resume then
        restores `consumed` from the checkpoint."""
        self.consumed, self.total, self.input_tokens = 0, total, 0

    @property
    def fraction(self) -> float:
        return min(1.0, self.consumed / self.total) if self.total else 0.0


@dataclass
class ODBRun:
    """What the run's YAML asked of ODB (`options`) and what it has trained (`progress`)."""

    options: ODBRunOptions
    progress: SampleProgress = field(default_factory=SampleProgress)

    @property
    def enabled(self) -> bool:
        return self.options.adapter.enable

    @property
    def step_mode(self) -> StepMode:
        return step_mode(self.options.config.step_mode)


def attach(run: Optional[ODBRun], *lf_arguments: Any) -> None:
    """Hand `run` on with LLaMA-Factory's argument objects (None: a run without ODB)."""
    for arguments in lf_arguments:
        setattr(arguments, ATTRIBUTE, run)


def run_of(lf_arguments: Any, enabled_only: bool = True) -> Optional[ODBRun]:
    """The ODB run these LLaMA-Factory arguments belong to (None: their YAML has no `odb_*`
    keys, or, with `enabled_only`, does not set odb_enable: true)."""
    run = getattr(lf_arguments, ATTRIBUTE, None)
    return run if run is not None and (run.enabled or not enabled_only) else None
