"""The ODB trainer inside LLaMA-Factory's own `run_exp`, in this process, on one rank: what
`odb_factory/llamafactory/trainer.py` decides and hands on, read from the trainer itself (its
loader's configuration, its logs, its metrics, the positions its forwards computed logits at).
The same runs on 2 ranks through the stock CLI are in test_e2e.py, test_samples_mode.py and
test_stage_pt.py; one rank in-process takes about 2 s a run."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing

import pytest

from tests.helpers import lf_runs
from tests.helpers.lf_runs import base_yaml, log_history

pytest.importorskip("llamafactory")


@pytest.fixture(scope="module")
def run_exp(lf):
    """LLaMA-Factory's `run_exp` with the patches applied (`lf`), offline (for this module only)."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in lf_runs.env().items():
            if key.endswith("_OFFLINE") or key in ("DISABLE_VERSION_CHECK", "TOKENIZERS_PARALLELISM"):
                patch.setenv(key, value)
        from llamafactory.train.tuner import run_exp
        yield run_exp


@pytest.fixture
def trained(run_exp, monkeypatch):
    """train(config, callbacks) -> (the ODB trainer of the run or None, the `odb_factory` log
    lines): runs `config` in this process, with HF callbacks `callbacks` besides the run's."""
    from odb_factory.llamafactory.trainer import ODBTrainerMixin
    built = []
    init = ODBTrainerMixin.__init__

    def recording_init(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)
        self.logit_rows = _lm_head_rows(self)
    monkeypatch.setattr(ODBTrainerMixin, "__init__", recording_init)

    def train(config, callbacks=None):
        built.clear()
        with _odb_log_lines() as (lines, odb_logger):
            before = set(odb_logger.handlers)
            children = set(multiprocessing.active_children())
            run_exp(config, callbacks)
            # the loader's worker processes end with the training
            assert set(multiprocessing.active_children()) <= children
            train.logger_after = (set(odb_logger.handlers) - before, odb_logger.level)
        return (built[0] if built else None), lines
    train.built = built
    return train


@contextlib.contextmanager
def _odb_log_lines(level=None):
    """(the messages the `odb_factory` logger emits meanwhile, the logger), at `level` if given;
    afterwards the logger's handlers and level are as they were (the trainer hands it
    LLaMA-Factory's handlers for the rest of its process, which later tests would see)."""
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    odb_logger = logging.getLogger("odb_factory")
    handlers, previous = odb_logger.handlers[:], odb_logger.level
    odb_logger.addHandler(handler)
    if level is not None:
        odb_logger.setLevel(level)
    try:
        yield lines, odb_logger
    finally:
        odb_logger.handlers[:] = handlers
        odb_logger.setLevel(previous)


def _pt(model, data, out, max_samples=48, **extra):
    return base_yaml(model, data, out, stage="pt", dataset="docs", template="qwen3_nothink", cutoff_len=256,
                     max_samples=max_samples, per_device_train_batch_size=2, gradient_accumulation_steps=3,
                     learning_rate=2e-3, warmup_ratio=0.1, max_grad_norm=1.0, seed=3, **extra)


def _steps(out):
    return [h for h in log_history(out) if "loss" in h]


def _token_mean_loss(model_dir, dataset, indices):
    """The next-token cross entropy over the supervised tokens of `dataset[indices]` (stage pt:
    every token), each sample on its own, under the model saved in `model_dir`."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in indices:
            logits = model(input_ids=torch.tensor([dataset[i]["input_ids"]])).logits[0, :-1]
            target = torch.tensor(dataset[i].get("labels", dataset[i]["input_ids"])[1:])  # pt: every token
            kept = target != -100
            total += torch.nn.functional.cross_entropy(logits[kept], target[kept], reduction="sum").item()
            count += int(kept.sum())
    return total / count


def _progress_bar_ends(trainer_of):
    """An HF callback recording HF's training progress bar as (total at the first step, steps
    shown at the end, total at the end); it runs before HF's ProgressCallback."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import ProgressCallback

    class ProgressBarEnds(TrainerCallback):
        def __init__(self):
            self.seen = []

        def bar(self):
            handler = trainer_of().callback_handler
            return next(c for c in handler.callbacks if isinstance(c, ProgressCallback)).training_bar

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.seen = [self.bar().total]

        def on_train_end(self, args, state, control, **kwargs):
            self.seen += [self.bar().n, self.bar().total]
    return ProgressBarEnds()


def _lm_head_rows(trainer):
    """Rows of logits each training forward of `trainer`'s model computes (a hook on the LM head)."""
    rows = []
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: rows.append(output.shape[:-1].numel()) if module.training else None)
    return rows


def test_samples_mode_trains_the_standard_model_in_process(trained, tmp_path, text_model, pt_data):
    """`odb_step: samples` (the default) on one rank: Standard's optimizer steps, losses, learning
    rates and gradient norms; logits at the supervised positions only; every input token counted
    once in `odb_input_tokens`; the loader's workers gone after training."""
    none, _ = trained(_pt(text_model, pt_data, tmp_path / "std", packing=False))
    assert none is None   # without odb_enable, upstream's trainer
    trainer, lines = trained(_pt(text_model, pt_data, tmp_path / "odb", odb_enable=True))
    std, odb = _steps(tmp_path / "std"), _steps(tmp_path / "odb")
    assert [h["step"] for h in odb] == [h["step"] for h in std] == list(range(1, 9))
    for a, b in zip(std, odb):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["learning_rate"] == pytest.approx(a["learning_rate"], rel=1e-9)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["odb/samples_per_optimizer_step"] == 6
    assert trainer.args.ignore_data_skip  # ODB restores its own data position on resume
    # ODB's lines go out through LLaMA-Factory's handlers, info lines included on the main process
    handlers, level = trained.logger_after
    assert set(logging.getLogger("llamafactory").handlers) <= handlers and handlers
    assert level == logging.INFO
    loader = trainer._odb_train_loader.loader
    assert loader._sample_loader._iterator is None and loader._collate_loader._iterator is None
    tokens = sum(len(loader.dataset[i]["input_ids"]) for i in range(len(loader.dataset)))
    metrics = json.loads((tmp_path / "odb" / "train_results.json").read_text())
    assert metrics["odb_input_tokens"] == tokens
    assert sum(trainer.logit_rows) == tokens - 48  # each document's tokens but its first
    assert trainer.odb_run.progress.total == 48 and trainer.odb_run.progress.consumed == 48
    assert lines == [
        "ODB: padding-free groups (model type 'qwen3' trains packed rows with per-sample attention, so a group "
        "costs its real tokens); packed rows attend per sample, one causal sdpa call each (no mask; "
        "odb_packed_attention: segments)",
        "ODB: odb_token_budget 1024 (odb_token_budget: auto, odb_step: samples on CPU, where a packed row costs "
        "more per token once memory runs short; the model is the same)",
        "ODB: post-balancing off (odb_balance: auto, one rank: nothing to re-deal)"]


def test_a_vision_model_hands_its_token_ids_and_collator_on_to_the_loader(trained, tmp_path, tiny_model, demo_data):
    """Tiny Qwen3-VL, stage sft: the loader plans with the model's image and video placeholder
    ids (and an audio one, under the name the Omni configs give it), the collator's padding
    multiple, packed rows cut at `odb_padding_free_row_tokens` and padded with the tokenizer's
    id, `data_seed` over `seed`, at least one worker, and the loss a model with a processor gets
    from LLaMA-Factory (each micro-batch's mean, `micro_mean`); and still trains Standard's
    model."""
    import shutil
    model = shutil.copytree(tiny_model, tmp_path / "model")
    model_config = dict(json.loads((model / "config.json").read_text()), audio_token_index=2099)
    (model / "config.json").write_text(json.dumps(model_config))

    def config(out, **extra):
        return base_yaml(model, demo_data, out, data_seed=11, dataloader_num_workers=0, max_samples=24,
                         gradient_accumulation_steps=2, **extra)
    trained(config(tmp_path / "std"))
    trainer, _ = trained(config(tmp_path / "odb", odb_enable=True, odb_padding_free_row_tokens=384))
    # packed rows of at most odb_padding_free_row_tokens, completed with the tokenizer's padding
    collate = trainer._odb_train_loader.loader.collate_fn
    assert (collate.row_tokens, collate.pad_token_id) == (384, trainer.data_collator.tokenizer.pad_token_id)
    assert collate.pad_token_id not in (None, 0)
    loader_config = trainer._odb_train_loader.loader.config
    assert loader_config.vision_token_ids == (model_config["image_token_id"], model_config["video_token_id"])
    assert loader_config.audio_token_ids == (2099,)
    assert loader_config.pad_to_multiple_of == trainer.data_collator.pad_to_multiple_of == 8
    assert (loader_config.seed, loader_config.num_workers, loader_config.standard_batch_size) == (11, 1, 2)
    assert (loader_config.gradient_accumulation_steps, loader_config.loss_scaling) == (2, "micro_mean")
    assert loader_config.balance is False
    std, odb = _steps(tmp_path / "std"), _steps(tmp_path / "odb")
    assert [h["step"] for h in odb] == [h["step"] for h in std] == list(range(1, 7))
    for a, b in zip(std, odb):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_groups_mode_trains_each_sample_once_with_the_supervised_logits_only(trained, tmp_path, text_model,
                                                                           pt_data):
    """`odb_step: groups`: each of the 48 training documents once in the audit ledger, 3
    token-budgeted groups per optimizer step (the start-up warning says so), the exact loss;
    computing the logits at the supervised positions only changes no logged loss, and
    evaluation (HF's own loop) still reads every position."""
    def config(out, **extra):
        return _pt(text_model, pt_data, out, odb_enable=True, odb_step="groups", odb_token_budget=512,
                   max_samples=56, val_size=8, do_eval=True, eval_strategy="no", per_device_eval_batch_size=4,
                   **extra)
    every, _ = trained(config(tmp_path / "every", odb_supervised_logits=False))
    bar = _progress_bar_ends(lambda: trained.built[0])
    trainer, lines = trained(config(tmp_path / "odb", odb_audit_dir=str(tmp_path / "audit")), [bar])
    rows = lf_runs.ledger(tmp_path / "audit")
    samples = len(trainer.train_dataset)
    assert samples == 56 - 8
    estimate, shown, total = bar.seen  # HF's bar ends at the real step count, not at its first estimate
    assert (shown, total) == (len(rows), len(rows)) and estimate != len(rows)
    assert sorted(i for r in rows for i in r["indices"]) == list(range(samples))
    assert [r["micro_steps"] for r in rows][:-1] == [3] * (len(rows) - 1)
    steps = _steps(tmp_path / "odb")
    assert [h["step"] for h in steps] == [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert [h["odb/samples_per_optimizer_step"] for h in steps] == [len(r["indices"]) for r in rows]
    for a, b in zip(_steps(tmp_path / "every"), steps):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert trainer._odb_loss == "exact"
    # evaluation reads every position's logits, in either run
    evaluated = [json.loads((tmp_path / out / "eval_results.json").read_text())["eval_loss"]
                 for out in ("every", "odb")]
    assert evaluated[1] == pytest.approx(evaluated[0], rel=1e-6)
    tokens = trainer.odb_run.progress.input_tokens
    assert tokens == sum(r["input_tokens"] for r in rows)
    assert sum(trainer.logit_rows) < tokens <= sum(every.logit_rows)
    # the exact loss: step 1's logged loss is its samples' token mean under the initial weights
    first = _token_mean_loss(text_model, trainer._odb_train_loader.loader.dataset, rows[0]["indices"])
    assert steps[0]["loss"] == pytest.approx(first, rel=1e-5)
    assert lines[1:] == [
        "ODB: post-balancing off (odb_balance: auto, odb_step: groups (set odb_balance: true to post-balance its "
        "groups))",
        "ODB: odb_step: groups: every optimizer step holds 3 token-budgeted groups per rank, not the recipe's 6 "
        "samples per rank; the number of samples per optimizer step is logged as odb/samples_per_optimizer_step"]


@pytest.mark.parametrize("max_steps,total", [(0, 2 * 24), (1, 24)])
def test_the_sample_progress_spans_the_runs_epochs(trained, tmp_path, text_model, pt_data, max_steps, total):
    """Groups mode's schedule runs on the fraction of the run's samples trained: two epochs'
    samples when the epochs bound the run (`max_steps` unset or 0), one epoch's when
    `max_steps` does; each epoch's samples trained once."""
    trainer, _ = trained(_pt(text_model, pt_data, tmp_path / "odb", odb_enable=True, odb_step="groups",
                             odb_token_budget=512, max_samples=24, num_train_epochs=2, max_steps=max_steps))
    progress = trainer.odb_run.progress
    assert progress.total == total
    if not max_steps:
        assert progress.consumed == total and _steps(tmp_path / "odb")[-1]["epoch"] == 2


@pytest.mark.parametrize("step_mode", ["groups", "samples"])
def test_a_resumed_run_continues_the_uninterrupted_one(trained, tmp_path, text_model, pt_data, step_mode):
    """A run resumed from its checkpoint at step 3 logs the uninterrupted run's later steps: the
    same losses and learning rates, and the same final step."""
    def config(out, **extra):
        return _pt(text_model, pt_data, out, odb_enable=True, odb_step=step_mode, odb_token_budget=512,
                   save_strategy="steps", save_steps=3, **extra)
    trained(config(tmp_path / "whole"))
    trained(config(tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-3")))
    whole, resumed = _steps(tmp_path / "whole"), _steps(tmp_path / "resumed")  # the first 3: the checkpoint's
    assert [h["step"] for h in resumed] == [h["step"] for h in whole] and len(whole) > 5
    for a, b in zip(whole[3:], resumed[3:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["learning_rate"] == pytest.approx(a["learning_rate"], rel=1e-9)


def test_dpo_samples_mode_trains_the_standard_model_in_process(trained, tmp_path, text_model, pair_data):
    """Stage dpo, `odb_step: samples`: each pair's DPO loss weighted as Standard's micro-batch
    means weigh it; the same losses, learning rates, gradient norms and eval loss (its reward
    metrics stay means over whatever a micro-batch holds)."""
    def config(out, **extra):
        return base_yaml(text_model, pair_data, out, stage="dpo", dataset="pairs", template="qwen3_nothink",
                         cutoff_len=256, max_samples=48, per_device_train_batch_size=2,
                         gradient_accumulation_steps=3, learning_rate=1e-3, max_grad_norm=1.0, pref_beta=0.1,
                         val_size=0.2, per_device_eval_batch_size=4, eval_strategy="no", do_eval=True, seed=3,
                         **extra)
    trained(config(tmp_path / "std"))
    trainer, _ = trained(config(tmp_path / "odb", odb_enable=True, odb_token_budget=2048))
    assert trainer._odb_train_loader.loader._costed.cost_fn.pad_to_multiple_of == 8
    std, odb = _steps(tmp_path / "std"), _steps(tmp_path / "odb")
    assert [h["step"] for h in odb] == [h["step"] for h in std] == list(range(1, 8))
    assert any(h["odb/micro_steps_per_optimizer_step"] < 3 for h in odb), "no pairs were grouped"
    for a, b in zip(std, odb):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["learning_rate"] == pytest.approx(a["learning_rate"], rel=1e-9)
    std_eval, odb_eval = (json.loads((out / "eval_results.json").read_text()) for out in (tmp_path / "std",
                                                                                          tmp_path / "odb"))
    assert sorted(odb_eval) == sorted(std_eval) and "eval_rewards/margins" in odb_eval
    for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_logps/chosen"):
        assert odb_eval[key] == pytest.approx(std_eval[key], rel=1e-5), key

    # outside the training loop the mixin keeps the DPO trainer's interface: a batch without
    # weights gets its own mean, its outputs on request, metrics named for the split asked
    import torch
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    with torch.no_grad():
        loss, outputs = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
        mean, metrics = trainer.get_batch_loss_metrics(trainer.model, dict(batch))
        for evaluated in (trainer.get_batch_loss_metrics(trainer.model, dict(batch), "eval"),
                          trainer.get_batch_loss_metrics(trainer.model, dict(batch), train_eval="eval")):
            assert evaluated[0].item() == pytest.approx(mean.item(), rel=1e-6)
            assert sorted(evaluated[1]) == sorted("eval_" + key for key in metrics)
    assert loss.item() == pytest.approx(mean.item(), rel=1e-6) and "rewards/margins" in metrics
    assert sorted(outputs) == sorted(metrics)
    logps = dict(zip(("policy_chosen_logps", "policy_rejected_logps", "reference_chosen_logps",
                      "reference_rejected_logps"), torch.tensor([[-3.0, -4.0], [-5.0, -4.5], [-3.5, -4.0], [-4.0, -4.2]])))
    by_name = trainer.compute_preference_loss(**logps)
    assert trainer._odb_pair_losses is by_name[0]
    assert all(torch.equal(a, b) for a, b in zip(by_name, trainer.compute_preference_loss(*logps.values())))


def _encoder_stages_on_rank(rank, world, model_type, audio, vision, explicit_ranks_per_node):
    """The trainer's encoder-stage choice on this rank, for a model of `model_type`: per stage,
    (name, balancer class, balancer's ranks per node and timeout, its group's size, the group's
    own timeout, whether it is the default group); the model's patch removed afterwards."""
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace

    from odb_factory.encoder_stage import qwen2_5_omni_patch, qwen3_vl_patch
    from odb_factory.llamafactory.trainer import ODBTrainerMixin
    config = SimpleNamespace(sync_timeout_s=37.0, ranks_per_node=explicit_ranks_per_node)
    model = SimpleNamespace(config=SimpleNamespace(model_type=model_type))
    trainer = SimpleNamespace(_odb=SimpleNamespace(config=config, audio_stage=audio, vision_stage=vision),
                              model="wrapped", accelerator=SimpleNamespace(unwrap_model={"wrapped": model}.get))
    try:
        chosen = ODBTrainerMixin._odb_balance_encoder_stages(trainer)
        return [(stage, type(b).__name__, b.ranks_per_node, b.timeout_s, dist.get_world_size(b.group),
                 b.group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
                 b.group is dist.group.WORLD) for stage, b in chosen]
    finally:
        qwen3_vl_patch.remove()
        qwen2_5_omni_patch.remove()


@pytest.mark.parametrize("model_type,audio,vision,ranks_per_node,expected", [
    ("qwen3_vl", False, True, None, [("vision", "VisionBalancer", 2)]),
    ("qwen3_vl", False, True, 1, [("vision", "VisionBalancer", 1)]),
    ("qwen2_5_omni_thinker", True, True, None, [("audio", "AudioBalancer", 2), ("vision", "VisionBalancer", 2)]),
    ("qwen2_5_omni", False, True, None, [("vision", "VisionBalancer", 2)]),
    ("qwen2_5_omni", True, False, None, [("audio", "AudioBalancer", 2)]),
])
def test_encoder_stages_balance_over_a_group_of_their_own(model_type, audio, vision, ranks_per_node, expected):
    """On 2 gloo ranks: Qwen3-VL balances its vision stage, an Omni
    thinker each stage its YAML turns on, in that order (audio, vision); over a new group of all
    ranks (not the default one, whose exchanges DDP and the loader share) with the run's
    `odb_sync_timeout`, and `odb_ranks_per_node` or every rank on one node."""
    from tests.helpers.distributed import run_world
    results = run_world(_encoder_stages_on_rank, 2, model_type, audio, vision, ranks_per_node, timeout=120)
    assert results[0] == results[1] == [(stage, name, per_node, 37.0, 2, 37.0, False)
                                        for stage, name, per_node in expected]


def test_one_rank_balances_no_encoder_stage():
    """Without a process group (one process) or on one rank, nothing to re-deal."""
    from types import SimpleNamespace

    from odb_factory.llamafactory.trainer import ODBTrainerMixin
    assert ODBTrainerMixin._odb_balance_encoder_stages(SimpleNamespace()) == []
    from tests.helpers.distributed import run_world
    assert run_world(_encoder_stages_on_rank, 1, "qwen3_vl", False, True, None) == [[]]


def _input_tokens_of_all_ranks(rank, world):
    from types import SimpleNamespace

    from odb_factory.llamafactory.trainer import ODBTrainerMixin
    trainer = SimpleNamespace(odb_run=SimpleNamespace(progress=SimpleNamespace(input_tokens=2 ** 40 + 3 * rank)))
    return ODBTrainerMixin._odb_input_tokens_all_ranks(trainer)


def test_the_input_tokens_metric_sums_every_rank_exactly():
    """`odb_input_tokens` (what the tokens-per-second figure reads): every rank's trained input
    tokens, summed exactly beyond float32's integers; one process alone counts its own."""
    from tests.helpers.distributed import run_world
    assert run_world(_input_tokens_of_all_ranks, 3) == [3 * 2 ** 40 + 9] * 3
    assert _input_tokens_of_all_ranks(0, 1) == 2 ** 40


def test_padding_free_is_settled_by_the_loaded_model_where_the_recipe_could_not():
    """A model the parser could not read (a hub id) is settled by the trainer: by its type and
    whether its decoder runs flash attention (packed rows then attend through varlen kernels;
    without it `odb_packed_attention: mask` would build dense masks, so padded groups), each
    choice logged with its reason; an earlier decision stands."""
    from types import SimpleNamespace

    from odb_factory.llamafactory.arguments import parse_odb_arguments
    from odb_factory.llamafactory.trainer import ODBTrainerMixin

    def choose(model_type, attention, packed_attention="mask", options=None):
        options = options or parse_odb_arguments({"odb_enable": True, "odb_packed_attention": packed_attention})
        model = SimpleNamespace(config=SimpleNamespace(model_type=model_type, _attn_implementation=attention))
        return ODBTrainerMixin._odb_choose_padding_free(SimpleNamespace(_odb=options), model), options
    with _odb_log_lines(logging.INFO) as (lines, _):
        chosen, options = choose("qwen3", "flash_attention_2")
        assert (chosen, options.padding_free) == ("varlen", True)
        assert choose("gemma3", "sdpa", options=options)[0] == "mask"  # decided: the type no longer asks
        assert choose("qwen3", "sdpa")[0] is None
        assert choose("gemma3", "flash_attention_2", "segments")[0] is None
        assert ODBTrainerMixin._odb_choose_padding_free(SimpleNamespace(), None) is None
    assert lines == [
        "ODB: padding-free groups (model type 'qwen3' trains packed rows with per-sample attention, so a group "
        "costs its real tokens); packed rows attend per sample through flash attention's varlen kernels",
        "ODB: padding-free groups (model type 'qwen3' trains packed rows with per-sample attention, so a group "
        "costs its real tokens); packed rows attend through transformers' dense (Σ len)² block-causal mask "
        "(odb_packed_attention: mask)",
        "ODB: padded groups (odb_packed_attention: mask without flash attention builds a dense (Σ len)² mask per "
        "row, which can cost more than the padding)",
        "ODB: padded groups (model type 'gemma3' is not verified for packed rows)"]


def test_what_the_loaded_model_cannot_train_is_refused_where_the_recipe_could_not_tell(trained, tmp_path, text_model,
                                                                                        pt_data, monkeypatch):
    """A hub id's config.json is not read at parse time: the trainer refuses, once the model is
    loaded, what its type cannot train, in the words of the parse-time refusal."""
    from odb_factory.llamafactory import arguments
    monkeypatch.setattr(arguments, "check_model", lambda odb, raw: None)  # as for a hub id
    with pytest.raises(ValueError, match=r"^odb_balance_stages: \[vision\] supports Qwen3-VL and Qwen2.5-Omni models; "
                                         r"this model is 'qwen3'\. Use odb_balance_stages: \[llm\]$"):
        trained(_pt(text_model, pt_data, tmp_path / "odb", odb_enable=True, odb_balance=True,
                    odb_balance_stages=["llm", "vision"]))


def test_supervised_logits_need_a_forward_that_takes_logits_to_keep(text_model):
    """`odb_supervised_logits` reads the forward's signature: a LoRA model's own forward takes
    only *args/**kwargs, so its base model's is read; a model without `logits_to_keep` computes
    logits at every position, which the log says with the model's class."""
    import inspect
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from odb_factory.llamafactory.arguments import parse_odb_arguments
    from odb_factory.llamafactory.trainer import ODBTrainerMixin, takes_logits_to_keep
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(text_model), LoraConfig(target_modules=["q_proj"]))
    assert "logits_to_keep" not in inspect.signature(lora.forward).parameters
    trainer = SimpleNamespace(_odb=parse_odb_arguments({"odb_enable": True}))
    assert trainer._odb.adapter.supervised_logits
    with _odb_log_lines(logging.INFO) as (lines, _):
        assert takes_logits_to_keep(lora) and ODBTrainerMixin._odb_choose_supervised_logits(trainer, lora) is True
        assert ODBTrainerMixin._odb_choose_supervised_logits(trainer, torch.nn.Linear(2, 2)) is False
    assert lines == ["ODB: logits at every position (Linear.forward takes no logits_to_keep)"]
