"""Audio-stage post-balancing: clips are encoded where the plan says, and their embeddings
come back to the rank that holds their text.

``AudioBalancer(group).encode(input_features, feature_attention_mask, audio_tower)`` is a
collective. On every rank it

1. keeps the valid frames of each clip, as upstream's ``get_audio_features`` does
   (``(clips, mel, 3000)`` padded features + mask -> ``(valid frames, mel)`` rows);
2. all-gathers the per-clip frame counts and plans (``plan_audio``: pure, identical on
   every rank);
3. sends each clip's valid frames to its audio rank (no autograd);
4. runs the tower once on its share, exactly as upstream runs it on a rank's clips
   (``audio_tower(frames^T, feature_lens, aftercnn_lens)``) -- on a dummy clip of
   ``DUMMY_FRAMES`` zero frames whose output is sliced to 0 rows when the share is empty,
   so every rank calls the tower (ZeRO-3 gathers, hooks and DDP's bookkeeping see the same
   calls) and the dummy adds exactly 0 to every gradient;
5. returns each clip's embeddings to its owner with the differentiable exchange and
   restores local clip order;

and returns the ``(embeddings, mel-frame rows)`` upstream's tower would return for the local
clips: ``embeddings`` has ``sum(audio_output_tokens(f))`` rows. Exact because the tower works
clip by clip: windows of ``2 * n_window`` frames never span two clips, and the sdpa/eager mask
is block-diagonal per window (Qwen2.5-Omni; Qwen3-Omni's tower is not, see
docs/encoder_balancing.md). When no rank has a clip, nothing runs on any rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from odb_factory.balance.audio_plan import QWEN25_OMNI_AUDIO, AudioPlan, plan_audio
from odb_factory.comm import ODBExchangeError, gather_objects, group_rank_world
from odb_factory.comm.row_exchange import HINT

from .balancer import StageBalancer
from .routing import return_outputs, send_inputs

DUMMY_FRAMES = 4  # the fewest frames that give one embedding (two stride-2 steps)


@dataclass
class AudioStepStats:
    """What one ``encode`` call did on this rank (``plan`` is the same on every rank)."""

    plan: AudioPlan | None
    local_clips: int = 0
    share_clips: int = 0
    dummy: bool = False
    plan_s: float = 0.0
    frame_exchange_s: float = 0.0
    tower_s: float = 0.0
    embed_exchange_s: float = 0.0
    frame_bytes_sent: int = 0
    embed_bytes_sent: int = 0

    def summary(self) -> dict:
        out = dict(self.plan.summary()) if self.plan is not None else {}
        out.update(local_clips=self.local_clips, share_clips=self.share_clips, dummy=self.dummy,
                   plan_s=self.plan_s, frame_exchange_s=self.frame_exchange_s,
                   tower_s=self.tower_s, embed_exchange_s=self.embed_exchange_s,
                   frame_bytes_sent=self.frame_bytes_sent, embed_bytes_sent=self.embed_bytes_sent)
        return out


def valid_frames(input_features: torch.Tensor | None,
                 feature_attention_mask: torch.Tensor | None) -> tuple[torch.Tensor | None, list[int]]:
    """``(valid frame rows (frames, mel), frames per clip)`` of a rank's padded clips."""
    if input_features is None:
        return None, []
    if feature_attention_mask is None:
        raise ValueError("audio balancing needs feature_attention_mask beside input_features "
                         "(which frames of each padded clip are valid)")
    mask = feature_attention_mask.bool()
    rows = input_features.permute(0, 2, 1)[mask]
    return rows, [int(v) for v in mask.sum(1).tolist()]


class AudioBalancer(StageBalancer):
    """Balance the audio tower's work across the ranks of ``group`` (see module doc and
    ``StageBalancer`` for the options)."""

    default_cost_model = QWEN25_OMNI_AUDIO

    def plan(self, local_frames: list[int], mel_bins: int, hidden: int,
             dtype: torch.dtype) -> AudioPlan:
        """All-gather every rank's clip frame counts and plan (same result on every rank)."""
        every = gather_objects(list(local_frames), self.group, "audio clip frames",
                               f"step {self.step}", self.timeout_s, hint=HINT,
                               error=ODBExchangeError)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return plan_audio(every, self.cost_model, ranks_per_node=self.ranks_per_node,
                          mode=self.mode, tolerance=self.tolerance, placement=self.placement,
                          frame_bytes=mel_bins * itemsize, embed_row_bytes=hidden * itemsize)

    def encode(self, input_features: torch.Tensor | None,
               feature_attention_mask: torch.Tensor | None, audio_tower: Any) -> torch.Tensor:
        """Embeddings of this rank's clips in local clip order, as upstream's
        ``get_audio_features`` would return them (its ``last_hidden_state``). Collective over
        ``group``: every rank calls it, also with ``input_features=None``."""
        param = next(audio_tower.parameters())
        hidden = int(audio_tower.config.output_dim)
        empty = torch.empty((0, hidden), dtype=param.dtype, device=param.device)
        if not self.enabled:
            rows, frames = valid_frames(input_features, feature_attention_mask)
            return self._tower(audio_tower, rows, frames, param) if frames else empty
        share_out = self.encode_share(input_features, feature_attention_mask, audio_tower)
        if share_out is None:
            return empty
        stats = self.last_stats
        t0 = time.perf_counter()
        embeds, stats.embed_bytes_sent = return_outputs(
            share_out, stats.plan, group_rank_world(self.group)[0], self.group,
            what="audio embeddings", step=self.step, timeout_s=self.timeout_s)
        stats.embed_exchange_s = time.perf_counter() - t0
        return embeds

    def encode_share(self, input_features: torch.Tensor | None,
                     feature_attention_mask: torch.Tensor | None,
                     audio_tower: Any) -> torch.Tensor | None:
        """Steps 1-4 of ``encode``: the tower's output rows of this rank's share (share
        order), still to be returned to their owners (``self.last_stats.plan`` says how);
        None when no rank has a clip. Collective, like ``encode``."""
        param = next(audio_tower.parameters())
        mel_bins, hidden = int(audio_tower.config.num_mel_bins), int(audio_tower.config.output_dim)
        rows, frames = valid_frames(input_features, feature_attention_mask)
        rank, _ = group_rank_world(self.group)
        self.step += 1
        stats = AudioStepStats(plan=None)
        t0 = time.perf_counter()
        plan = self.plan(frames, mel_bins, hidden, param.dtype)
        stats.plan, stats.plan_s = plan, time.perf_counter() - t0
        stats.local_clips, stats.share_clips = len(frames), len(plan.shares[rank])
        self._record(stats)
        if plan.num_items == 0:  # nobody has a clip: skip on every rank alike
            return None

        t0 = time.perf_counter()
        if rows is None:
            rows = torch.empty((0, mel_bins), dtype=param.dtype, device=param.device)
        share, stats.frame_bytes_sent = send_inputs(
            rows.detach().to(device=param.device, dtype=param.dtype), plan, rank, self.group,
            what="audio frames", step=self.step, timeout_s=self.timeout_s)
        stats.frame_exchange_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        share_frames = plan.share_frames(rank)
        if not share_frames:
            stats.dummy = True
            share = torch.zeros((DUMMY_FRAMES, mel_bins), dtype=param.dtype, device=param.device)
            share_frames = [DUMMY_FRAMES]
        out = self._tower(audio_tower, share, share_frames, param)
        if stats.dummy:
            out = out[:0]
        stats.tower_s = time.perf_counter() - t0
        return out

    @staticmethod
    def _tower(audio_tower: Any, rows: torch.Tensor, frames: list[int], param) -> torch.Tensor:
        lens = torch.tensor(frames, dtype=torch.long, device=param.device)
        after_cnn, _ = audio_tower._get_feat_extract_output_lengths(lens)
        out = audio_tower(rows.to(param.dtype).t(), feature_lens=lens, aftercnn_lens=after_cnn)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
