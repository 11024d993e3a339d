"""The audit ledger: one JSON line per optimizer step and rank (`odb_audit_dir`), and its reader.

A line holds what the rank trained in that optimizer step: the dataset rows, input and padded
tokens, the attention term Σ n·L² of its padded micro-batches, vision patches, audio frames, micro-steps
(and how many were IDLE) and the wall time. Tests read it to prove coverage; `bench/` reads
it to fit the step-time model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

FILE = "rank{rank}.jsonl"
GLOB = "rank*.jsonl"


def step_record(step: int, epoch: int, micro_steps: Sequence, row_of: Callable[[int], int]) -> dict:
    """The ledger line of one optimizer step from its ODBBatch micro-steps."""
    return {
        "step": step, "epoch": epoch,
        "indices": [row_of(i) for s in micro_steps for i in s.indices],
        "input_tokens": sum(s.input_tokens for s in micro_steps),
        "padded_tokens": sum(s.padded_tokens for s in micro_steps),
        # n * L^2 of each padded micro-batch: the attention term of a step-time model
        "attention_cost": sum(s.padded_tokens * s.padded_tokens / len(s.indices)
                              for s in micro_steps if s.indices),
        "vision_patches": sum(s.vision_patches for s in micro_steps),
        "audio_frames": sum(s.audio_frames for s in micro_steps),
        "wall_time": time.time(),
        "micro_steps": len(micro_steps),
        "idle_micro_steps": sum(s.is_idle for s in micro_steps),
    }


class AuditLedger:
    def __init__(self, audit_dir: str, rank: int):
        self.path = Path(audit_dir) / FILE.format(rank=rank)

    def open(self, after_step: int = 0) -> None:
        """Start writing after optimizer step `after_step` (a resume: the checkpoint's step; a
        new run: 0). Lines of later steps, from a run that went on past that checkpoint, are
        dropped: those steps are trained again, so each (sample, step) stays in the ledger once."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line and json.loads(line)["step"] <= after_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_rank_ledgers(audit_dir: str) -> List[List[dict]]:
    """ledgers[rank] = that rank's lines, in step order."""
    paths = sorted(Path(audit_dir).glob(GLOB), key=lambda p: int(p.stem[4:]))
    if not paths:
        raise FileNotFoundError(f"no {GLOB} ledger in {audit_dir}")
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in paths]


def read_ledger(audit_dir: str, max_step: Optional[int] = None) -> List[dict]:
    """Every rank's lines in one list, each with its `rank`; up to `max_step` if given."""
    rows = []
    for rank, lines in enumerate(read_rank_ledgers(audit_dir)):
        rows += [dict(row, rank=rank) for row in lines if max_step is None or row["step"] <= max_step]
    return rows
