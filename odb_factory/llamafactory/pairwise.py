"""Stage dpo: every sample is a chosen/rejected pair, kept whole in one micro-batch.

LLaMA-Factory's pairwise collator turns n pairs into 2n rows (the chosen rows, then the
rejected rows) padded to the longest of them, and its DPO trainer splits the batch back in
halves. So a pair costs two rows of its longer side (`PairCost`), and `samples` mode weighs
each pair's loss as the fixed-batch run does: its DPO loss is the mean over a micro-batch's
pairs, averaged over the accumulation steps, which is `micro_mean` with one "label token" per
pair (`ODBPairwiseTrainerMixin`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..config import ODBConfig
from ..cost import CostFn, DefaultCost, SampleCost, padded_length
from .lazy_dataset import PAIR_SIDES
from .trainer import ODBTrainerMixin


class PairCost:
    """A processed pair's cost: `input_tokens` is what the pair occupies in a padded batch,
    two rows of its longer side rounded up to the collator's multiple (n pairs then cost
    2n × the longest row, exactly the batch the collator builds); `label_tokens` is 1, the
    pair's one term in the DPO loss's mean; vision patches and audio frames count both rows
    (the collator gives each row the pair's images). Picklable: it runs in the workers."""

    def __init__(self, side_cost: DefaultCost, pad_to_multiple_of: int):
        self.side_cost = side_cost
        self.pad_to_multiple_of = pad_to_multiple_of  # ODBConfig's, at least 1

    def __call__(self, pair: Any) -> SampleCost:
        # a side's labels are not read: the pair is one term of the loss, whatever it supervises
        sides = [self.side_cost({"input_ids": pair[prefix + "input_ids"]}) for prefix, _ in PAIR_SIDES]
        row = padded_length(max(side.input_tokens for side in sides), self.pad_to_multiple_of)
        return SampleCost(2 * row, 1, sum(s.vision_patches for s in sides), sum(s.audio_frames for s in sides))


class ODBPairwiseTrainerMixin(ODBTrainerMixin):
    """Mixed in front of LLaMA-Factory's CustomDPOTrainer. In `samples` mode a micro-batch
    holds pairs of several fixed-batch micro-batches: the loss is Σ weight · (the pair's DPO
    loss), from the per-pair losses the DPO trainer averages (its rewards, log-probs and
    logits metrics stay per micro-batch means)."""

    _odb_pair_weights: Optional[torch.Tensor] = None
    _odb_pair_losses: Optional[torch.Tensor] = None

    def _odb_cost_fn(self, config: ODBConfig) -> CostFn:
        return PairCost(DefaultCost.from_config(config), config.pad_to_multiple_of)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._odb_pair_weights = inputs.pop("odb_sample_weights", None)
        try:  # the DPO trainer's loss, not the mixin's token loss
            return super(ODBTrainerMixin, self).compute_loss(model, inputs, return_outputs)
        finally:
            self._odb_pair_weights = None

    def compute_preference_loss(self, *args, **kwargs):
        losses, chosen_rewards, rejected_rewards = super().compute_preference_loss(*args, **kwargs)
        self._odb_pair_losses = losses
        return losses, chosen_rewards, rejected_rewards

    def get_batch_loss_metrics(self, model, batch, *args, **kwargs):
        self._odb_pair_losses = None
        mean, metrics = super().get_batch_loss_metrics(model, batch, *args, **kwargs)
        weights = self._odb_pair_weights
        if weights is None:
            return mean, metrics
        # the per-pair losses the trainer averaged (its SFT term, pref_ftx, is added to them
        # in place); a trainer that averages something else is refused, not mis-weighted
        losses = self._odb_pair_losses
        if losses is None or losses.shape != weights.shape or not torch.allclose(losses.mean(), mean):
            raise RuntimeError("ODB stage dpo: the DPO trainer's loss is not the mean of the per-pair losses "
                               "compute_preference_loss returned (LLaMA-Factory 0.9.5's CustomDPOTrainer; "
                               "docs/upstream_contract.md)")
        return (losses * weights.to(losses)).sum(), metrics
