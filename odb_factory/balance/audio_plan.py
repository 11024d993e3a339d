"""Pure planning of the audio stage: which rank encodes which audio clip, and the bookkeeping
to bring each clip's embeddings back to the rank that holds its text.

Inputs are every rank's clips as their counts of *valid* mel frames (the feature
extractor pads every clip to 30 s; only valid frames reach the tower, so only they travel).
Qwen2.5-Omni's audio tower turns ``f`` frames into ``audio_output_tokens(f)`` embeddings
(two stride-2 steps: the second convolution and the average pooling).

Cost: the tower cuts each clip into windows of ``2 * n_window`` frames (2 s) and attends
within a window. With FlashAttention-2 a clip's cost is therefore about linear in its frames
(plus a per-clip overhead ``c0``); with sdpa or eager the tower builds one dense mask over all
frames of the call, so a rank's cost is an increasing function of its *total* frames. In both
cases balancing a per-clip cost ``c0 + a * frames`` (the default: frames) minimises the
slowest rank; ``odb_factory.stage_profiling --stage audio`` measures the tower.

The row bookkeeping is ``EncoderPlan``'s: an item's input rows are its valid frames (one row =
one frame of ``num_mel_bins`` values), its output rows its embeddings.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from odb_factory.balance.cost_model import StageCostModel
from odb_factory.balance.encoder_plan import EncoderPlan, assign_items, shares_and_costs

AUDIO_MODES = ("lpt", "min_move")
# Cost in mel frames: right up to a common factor for both attention implementations (module doc).
QWEN25_OMNI_AUDIO = StageCostModel(c0=0.0, a=1.0, b=0.0)


def audio_output_tokens(frames: int) -> int:
    """Embeddings Qwen2.5-Omni's audio tower returns for a clip of ``frames`` valid frames."""
    after_cnn = (frames - 1) // 2 + 1
    return (after_cnn - 2) // 2 + 1


@dataclass(frozen=True)
class AudioPlan(EncoderPlan):
    frames: tuple[tuple[int, ...], ...]        # per owner rank: valid frames of each clip
    encoder: tuple[tuple[int, ...], ...]       # per owner rank: audio rank of each clip
    shares: tuple[tuple[tuple[int, int], ...], ...]  # per audio rank: (owner, pos), sorted
    cost_before: tuple[float, ...]
    cost_after: tuple[float, ...]
    lower_bound: float
    frame_bytes: int = 1                       # one input row: num_mel_bins values
    embed_row_bytes: int = 1                   # one output row: the LLM's hidden size

    def in_rows(self, owner: int, pos: int) -> int:
        return self.frames[owner][pos]

    def out_rows(self, owner: int, pos: int) -> int:
        return audio_output_tokens(self.frames[owner][pos])

    @property
    def in_row_bytes(self) -> int:
        return self.frame_bytes

    @property
    def out_row_bytes(self) -> int:
        return self.embed_row_bytes

    def share_frames(self, rank: int) -> list[int]:
        return [self.frames[o][p] for o, p in self.shares[rank]]

    def summary(self) -> dict:
        return {**self.balance_summary(), "frames": sum(map(sum, self.frames)),
                "frame_bytes_moved": self.input_bytes_moved,
                "embed_bytes_moved": self.output_bytes_moved}


def _normalise(frames_per_rank: Sequence[Sequence[object]]) -> tuple[tuple[int, ...], ...]:
    if isinstance(frames_per_rank, (str, bytes)) or not isinstance(frames_per_rank, Sequence):
        raise ValueError("frames_per_rank must be a list with one list of frame counts per rank")
    if not frames_per_rank:
        raise ValueError("frames_per_rank must list at least one rank")
    out = []
    for r, clips in enumerate(frames_per_rank):
        row = []
        for i, f in enumerate(clips):
            if isinstance(f, bool) or not isinstance(f, numbers.Integral) or f < 1:
                raise ValueError(f"frames_per_rank[{r}][{i}] must be an integer >= 1 (valid mel "
                                 f"frames of one clip), got {f!r}")
            row.append(int(f))
        out.append(tuple(row))
    return tuple(out)


def clip_costs(cost_model, frames: Sequence[int]) -> np.ndarray:
    if not len(frames):
        return np.zeros(0)
    out = np.asarray(cost_model(np.asarray(frames, dtype=np.float64)), dtype=np.float64).ravel()
    if out.shape != (len(frames),) or not np.all(np.isfinite(out) & (out >= 0)):
        raise ValueError("cost_model must map frame counts to finite non-negative costs")
    return out


def plan_audio(frames_per_rank: Sequence[Sequence[object]],
               cost_model: StageCostModel = QWEN25_OMNI_AUDIO, *, ranks_per_node: int = 8,
               mode: str = "lpt", tolerance: float | None = None, placement: str | None = None,
               frame_bytes: int = 1, embed_row_bytes: int = 1, balanced: bool = True) -> AudioPlan:
    """Assign every clip to an audio rank so that per-rank audio cost is balanced
    (``balanced=False``: every rank encodes its own clips, for comparisons). ``mode`` and
    the byte-aware placement are those of ``plan_vision``. Pure and deterministic."""
    if mode not in AUDIO_MODES:
        raise ValueError(f"unknown audio balancing mode {mode!r}; valid modes: "
                         f"{', '.join(AUDIO_MODES)}")
    for name, v in (("frame_bytes", frame_bytes), ("embed_row_bytes", embed_row_bytes)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    frames = _normalise(frames_per_rank)
    costs = [clip_costs(cost_model, fs).tolist() for fs in frames]
    if balanced:
        sizes = [[f * frame_bytes + 2 * audio_output_tokens(f) * embed_row_bytes for f in fs]
                 for fs in frames]
        enc = assign_items(costs, sizes, ranks_per_node=ranks_per_node, mode=mode,
                           tolerance=tolerance, placement=placement)
    else:
        enc = [[r] * len(fs) for r, fs in enumerate(frames)]
    return AudioPlan(frames, **shares_and_costs(enc, costs), frame_bytes=int(frame_bytes),
                     embed_row_bytes=int(embed_row_bytes))
