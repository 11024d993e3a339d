"""What the patched LLaMA-Factory functions share within one process: the `odb_*`
options parsed for this run, and the training progress the LR schedule follows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .arguments import ODBRunOptions

# Set by the parser patch when the run's YAML has odb_enable: true; None otherwise, and
# then every patch falls through to upstream behaviour.
current: Optional[ODBRunOptions] = None


@dataclass
class SampleProgress:
    """Fraction of all samples of the run trained so far (all ranks, all epochs)."""
    consumed: int = 0
    total: int = 0
    input_tokens: int = 0   # LLM input tokens this rank trained in this process (not IDLE fillers)

    def start(self, total: int) -> None:
        """A new run in this process (a sweep, a notebook, several runs in one torchrun):
        nothing of an earlier run's progress may carry into its schedule or its counts."""
        self.consumed, self.total, self.input_tokens = 0, total, 0

    @property
    def fraction(self) -> float:
        return min(1.0, self.consumed / self.total) if self.total else 0.0


progress = SampleProgress()


def active() -> Optional[ODBRunOptions]:
    return current if current is not None and current.adapter.enable else None
