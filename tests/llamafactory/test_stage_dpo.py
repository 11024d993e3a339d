"""Stage dpo with ODB through the stock CLI, 2 CPU ranks: each chosen/rejected pair is one
sample, kept in one micro-batch and costed as the two padded rows it becomes, and
`odb_step: samples` trains the fixed-batch run's model: the same optimizer steps, losses,
learning rates and eval loss."""

from __future__ import annotations


import pytest

from tests.helpers import lf_runs
from tests.helpers.lf_runs import assert_trains_the_standard_model, base_yaml, ledger, train

pytest.importorskip("llamafactory")

REL = 1e-5


def _yaml(model, data, out, **extra):
    return base_yaml(model, data, out, stage="dpo", dataset="pairs", template="qwen3_nothink", cutoff_len=256,
                     max_samples=128, per_device_train_batch_size=2, gradient_accumulation_steps=4, val_size=0.1,
                     per_device_eval_batch_size=4, eval_strategy="no", do_eval=True, learning_rate=1e-3,
                     warmup_ratio=0.1, max_grad_norm=1.0, pref_beta=0.1, seed=3, **extra)


@pytest.mark.slow
def test_dpo_samples_mode_trains_the_standard_model(tmp_path, text_model, pair_data):
    std, odb, audit = tmp_path / "standard", tmp_path / "odb", tmp_path / "audit"
    train(_yaml(text_model, pair_data, std), nproc=2)
    proc = train(_yaml(text_model, pair_data, odb, odb_enable=True, odb_token_budget=2048, odb_audit_dir=str(audit)),
                 nproc=2)
    # the default post-balancing moves whole pairs between the ranks
    assert "ODB: post-balancing on (odb_balance: auto" in proc.stdout + proc.stderr
    assert any("odb/balance_max_over_lb" in h for h in lf_runs.log_history(odb))
    for a, b in assert_trains_the_standard_model(std, odb, REL):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    rows = ledger(audit)
    assert any(r["micro_steps"] < 4 for r in rows), "no pairs were grouped"
    trained = {i for r in rows for i in r["indices"]}  # (the last global batch wraps around, as Standard's)
    assert trained == set(range(max(trained) + 1)) and max(trained) > 100


def test_a_pair_costs_the_rows_the_collator_builds(text_model, pair_data, tmp_path):
    """n pairs grouped under the budget cost exactly the tokens of the batch LLaMA-Factory's
    pairwise collator builds of them (2n rows × the longest row, padded to its multiple)."""
    import odb_factory_patches
    from llamafactory.data import PairwiseDataCollatorWithPadding, get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    from odb_factory.config import ODBConfig
    from odb_factory.cost import DefaultCost
    from odb_factory.llamafactory.pairwise import PairCost
    from odb_factory.llamafactory.train_loader import LFCollate
    from odb_factory.planning.grouping import Budget, PlannedSample
    odb_factory_patches.apply()
    model_args, data_args, training_args, finetuning_args, _ = get_train_args(
        _yaml(text_model, pair_data, tmp_path / "o", odb_enable=True))
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    pairs = get_dataset(template, model_args, data_args, training_args, stage="rm", **tokenizer_module)["train_dataset"]
    collate = LFCollate(PairwiseDataCollatorWithPadding(template=template, model=None, pad_to_multiple_of=8,
                                                        **tokenizer_module))
    cost = PairCost(DefaultCost.from_config(ODBConfig()), pad_to_multiple_of=8)
    budget = Budget(4096, pad_to_multiple_of=8)
    for start, n in ((0, 1), (1, 3), (4, 5), (9, 8)):
        group = [PlannedSample(i, i, cost(pairs[i])) for i in range(start, start + n)]
        batch = collate([pairs[i] for i in range(start, start + n)])
        assert budget.group_cost(group) == batch["input_ids"].numel(), (start, n)
        assert batch["input_ids"].shape[0] == 2 * n
        assert all(s.cost.label_tokens == 1 for s in group)
        # text pairs: no vision patches or audio frames on either side
        assert all((s.cost.vision_patches, s.cost.audio_frames) == (0, 0) for s in group)


def test_a_pair_counts_the_media_tokens_of_both_sides():
    """Vision patches and audio frames of a pair: both rows', each counted from its own
    placeholder tokens (the collator gives each row the pair's media); its LLM cost stays two
    rows of the longer side, padded, and its loss term one."""
    from odb_factory.cost import FRAMES_PER_AUDIO_TOKEN, DefaultCost
    from odb_factory.llamafactory.pairwise import PairCost

    vision, audio = 7, 9
    cost = PairCost(DefaultCost(vision_token_ids=(vision,), spatial_merge_size=2, audio_token_ids=(audio,)),
                    pad_to_multiple_of=4)
    pair = {"chosen_input_ids": [1, vision, vision, audio, 2], "chosen_labels": [-100] * 4 + [2],
            "rejected_input_ids": [1, vision, vision, vision, audio, audio, 3], "rejected_labels": [-100] * 7}
    got = cost(pair)
    assert (got.input_tokens, got.label_tokens) == (2 * 8, 1)
    assert got.vision_patches == (2 + 3) * 2 ** 2
    assert got.audio_frames == (1 + 2) * FRAMES_PER_AUDIO_TOKEN


def test_dpo_refuses_groups_mode_and_padding_free_and_other_stages_keep_their_refusal(tmp_path, text_model,
                                                                                     pair_data):
    import odb_factory_patches
    from llamafactory.hparams import get_train_args

    from odb_factory.llamafactory.run import run_of
    odb_factory_patches.apply()
    with pytest.raises(ValueError, match="odb_step: groups: stage dpo trains the fixed-batch run's steps"):
        get_train_args(_yaml(text_model, pair_data, tmp_path / "o", odb_enable=True, odb_step="groups"))
    with pytest.raises(ValueError, match=r"odb_padding_free: true: stage dpo reads a batch as its chosen rows, "
                                         r"then its rejected rows; set odb_padding_free: auto or false"):
        get_train_args(_yaml(text_model, pair_data, tmp_path / "o", odb_enable=True, odb_padding_free=True))
    run = run_of(get_train_args(_yaml(text_model, pair_data, tmp_path / "o", odb_enable=True))[1])
    assert run.options.padding_free is False
    assert "stage dpo" in run.options.padding_free_reason
    kto = base_yaml(text_model, pair_data, tmp_path / "o", stage="kto", dataset="pairs", template="qwen3_nothink")
    with pytest.raises(ValueError, match=r"applies to stage \['sft', 'pt', 'dpo'\]; this run has stage 'kto'"):
        get_train_args(dict(kto, odb_enable=True))


@pytest.mark.parametrize("upstream_losses", ["none", "other shape", "other mean"])
def test_a_dpo_trainer_whose_loss_is_not_the_pair_mean_is_refused(upstream_losses):
    """The pair weights multiply the per-pair losses the DPO trainer averaged: a trainer that did
    not report them through compute_preference_loss, or whose loss is not their mean, is refused
    by name rather than mis-weighted; with them, the loss is Σ weight · pair loss."""
    import torch

    from odb_factory.llamafactory.pairwise import ODBPairwiseTrainerMixin

    class Upstream:
        def compute_preference_loss(self, *args, **kwargs):
            return torch.tensor([1.0, 3.0]), None, None

        def get_batch_loss_metrics(self, model, batch, train_eval="train"):
            if upstream_losses == "none":
                return torch.tensor(2.0), {}
            losses, _, _ = self.compute_preference_loss(batch)
            return (torch.tensor(2.5) if upstream_losses == "other mean" else losses.mean()), {"rewards": 1.0}

    class Trainer(ODBPairwiseTrainerMixin, Upstream):
        pass

    trainer = object.__new__(Trainer)
    trainer._odb_pair_weights = torch.tensor([0.25, 0.5, 0.25]) if upstream_losses == "other shape" else \
        torch.tensor([0.25, 0.5])
    with pytest.raises(RuntimeError, match="^ODB stage dpo: the DPO trainer's loss is not the mean of the per-pair "
                                           r"losses compute_preference_loss returned \(LLaMA-Factory 0.9.5's "
                                           r"CustomDPOTrainer; docs/upstream_contract.md\)$"):
        trainer.get_batch_loss_metrics(None, {})
    upstream_losses = "pair mean"  # from here on, Upstream averages its per-pair losses
    trainer._odb_pair_weights = torch.tensor([0.25, 0.5], dtype=torch.float64)
    loss, metrics = trainer.get_batch_loss_metrics(None, {})
    assert loss.item() == 0.25 * 1.0 + 0.5 * 3.0 and metrics == {"rewards": 1.0}
    assert loss.dtype == torch.float32  # the losses' own, whatever the weights' dtype
    trainer._odb_pair_weights = None  # evaluation: the trainer's own mean
    assert trainer.get_batch_loss_metrics(None, {})[0].item() == 2.0
