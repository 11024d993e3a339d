"""What the argument parser decides from a recipe's keys and the model folder's config.json
alone (odb_factory.llamafactory.arguments), one process: stage pt's packing, the DDP setups
that would stop on Qwen2.5-Omni's unused audio embedding, and `odb_padding_free: auto`'s
choice with its reason."""

from __future__ import annotations

import itertools
import json

import pytest

from odb_factory.llamafactory.arguments import (audio_stage_refusal, check_compatible, check_model, check_paths,
                                                ddp_unused_parameter_problems, model_refusal, packing_problem,
                                                parse_odb_arguments, settle_stage, stage_arguments,
                                                version_problems, vision_stage_refusal)
from odb_factory.llamafactory.padding_free import padding_free_refusal

OMNI_FULL = {"finetuning_type": "full", "freeze_vision_tower": False}


def test_stage_pt_trains_documents_whole_unless_packing_is_set():
    raw = {"stage": "pt", "cutoff_len": 64}
    assert stage_arguments(raw) == {"stage": "pt", "cutoff_len": 64, "packing": False} and "packing" not in raw
    assert stage_arguments({"stage": "pt", "packing": True}) == {"stage": "pt", "packing": True}
    assert stage_arguments({"stage": "pt", "packing": False}) == {"stage": "pt", "packing": False}
    assert stage_arguments({"stage": "sft"}) == {"stage": "sft"}
    assert stage_arguments({}) == {}   # sft by default: LLaMA-Factory's own packing default stands


@pytest.mark.parametrize("raw, model_type, world, problem", [
    (OMNI_FULL, "qwen2_5_omni", 2, "trains the audio tower"),        # checkpointing: no search for unused
    (OMNI_FULL, "qwen2_5_omni_thinker", 4, "trains the audio tower"),
    (dict(OMNI_FULL, ddp_find_unused_parameters=False), "qwen2_5_omni", 2, "trains the audio tower"),
    (dict(OMNI_FULL, disable_gradient_checkpointing=True), "qwen2_5_omni", 2, None),  # HF searches: fine
    (dict(OMNI_FULL, ddp_find_unused_parameters=True), "qwen2_5_omni", 2, "reentrant gradient checkpointing"),
    (dict(OMNI_FULL, ddp_find_unused_parameters=True, use_reentrant_gc=False), "qwen2_5_omni", 2, None),
    (dict(OMNI_FULL, ddp_find_unused_parameters=True, disable_gradient_checkpointing=True), "qwen2_5_omni", 2,
     None),
    (OMNI_FULL, "qwen2_5_omni", 1, None),                             # one process: no DDP
    (OMNI_FULL, "qwen3_vl", 2, None),
    (OMNI_FULL, None, 2, None),
    (dict(OMNI_FULL, deepspeed="ds_z2.json"), "qwen2_5_omni", 2, None),
    (dict(OMNI_FULL, fsdp="full_shard"), "qwen2_5_omni", 2, None),
    (dict(OMNI_FULL, finetuning_type="lora"), "qwen2_5_omni", 2, None),
    ({"freeze_vision_tower": False}, "qwen2_5_omni", 2, None),       # LLaMA-Factory's default: lora
    ({"finetuning_type": "full"}, "qwen2_5_omni", 2, None),          # the towers frozen by default
])
def test_ddp_setups_that_would_stop_on_an_unused_parameter_are_named(raw, model_type, world, problem):
    problems = ddp_unused_parameter_problems(raw, model_type, world)
    if problem is None:
        assert problems == []
    else:
        (message,) = problems
        assert problem in message


def test_the_unused_parameter_messages_say_what_to_set():
    (stop,) = ddp_unused_parameter_problems(OMNI_FULL, "qwen2_5_omni", 2)
    assert stop == ("freeze_vision_tower: false trains the audio tower of this qwen2_5_omni model, whose "
                    "audio_bos_eos_token no forward uses, so DDP would stop at the second step (\"Expected to "
                    "have finished reduction in the prior iteration\"); set ddp_find_unused_parameters: true "
                    "(with use_reentrant_gc: false), or keep freeze_vision_tower: true (it freezes the vision "
                    "and the audio tower)")
    (reentrant,) = ddp_unused_parameter_problems(dict(OMNI_FULL, ddp_find_unused_parameters=True), "qwen2_5_omni", 2)
    assert reentrant == ("ddp_find_unused_parameters: true with reentrant gradient checkpointing (use_reentrant_gc: "
                         "true, LLaMA-Factory's default) fails on the first backward (\"Expected to mark a variable "
                         "ready only once\"); set use_reentrant_gc: false, or disable_gradient_checkpointing: true")


def test_the_model_folder_decides_padding_free_and_names_what_it_rules_out(tmp_path, monkeypatch):
    folders = itertools.count()

    def decided(model_type, **keys):
        folder = tmp_path / f"model{next(folders)}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        odb = parse_odb_arguments({"odb_enable": True, **{k: v for k, v in keys.items() if k.startswith("odb_")}})
        check_model(odb, {"model_name_or_path": str(folder),
                          **{k: v for k, v in keys.items() if not k.startswith("odb_")}})
        return odb.padding_free, odb.padding_free_reason, odb.config.cost_mode

    assert decided("qwen3") == (True, "model type 'qwen3' trains packed rows with per-sample attention, so a "
                                      "group costs its real tokens", "packed")
    assert decided("gemma3") == (False, "model type 'gemma3' is not verified for packed rows", "padded")
    assert decided("qwen3", odb_packed_attention="mask") == (
        False, "odb_packed_attention: mask without flash attention builds a dense (Σ len)² mask per row, which "
               "can cost more than the padding", "padded")
    for flash in ("fa2", "fa3"):   # flash attention runs a packed row's segments as varlen calls
        assert decided("qwen3", odb_packed_attention="mask", flash_attn=flash)[0] is True
    assert decided("qwen3", odb_packed_attention="mask", flash_attn="sdpa")[0] is False

    monkeypatch.setenv("WORLD_SIZE", "2")   # torchrun's, in the processes that parse the recipe
    with pytest.raises(ValueError, match=r"^freeze_vision_tower: false trains the audio tower of this "
                                         r"qwen2_5_omni model"):
        decided("qwen2_5_omni", **OMNI_FULL)
    with pytest.raises(ValueError, match=r"^odb_padding_free: true: packed rows are verified for .*\n"
                                         r"freeze_vision_tower: false trains the audio tower"):
        decided("qwen2_5_omni", odb_padding_free=True, **OMNI_FULL)   # every reason, one per line
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert decided("qwen2_5_omni", **OMNI_FULL)[0] is False


def test_a_hub_model_id_is_left_to_the_loaded_model(tmp_path):
    odb = parse_odb_arguments({"odb_enable": True})
    check_model(odb, {"model_name_or_path": "Qwen/Qwen3-VL-8B-Instruct"})
    assert odb.padding_free is None   # undecided until the trainer sees the model


def test_the_padding_free_decision_is_returned_and_kept():
    odb = parse_odb_arguments({"odb_enable": True})
    assert odb.decide_padding_free("qwen3", flash_attention=False) is True
    assert odb.decide_padding_free("gemma3", flash_attention=False) is True   # decided once
    assert parse_odb_arguments({"odb_enable": True}).decide_padding_free("gemma3", flash_attention=False) is False


def test_stage_dpo_trains_padded_rows_and_says_why():
    odb = parse_odb_arguments({"odb_enable": True})
    settle_stage(odb, {"stage": "dpo"})
    assert (odb.padding_free, odb.padding_free_reason) == (
        False, "stage dpo: a batch is its chosen rows, then its rejected rows, one per pair")
    for raw in ({}, {"stage": "sft"}, {"stage": "pt"}):   # LLaMA-Factory's default stage is sft
        odb = parse_odb_arguments({"odb_enable": True})
        settle_stage(odb, raw)
        assert odb.padding_free is None


def test_a_model_the_options_can_train_has_no_refusal_and_every_reason_has_its_line():
    assert model_refusal(parse_odb_arguments({"odb_enable": True}), "qwen3") is None   # the trainer tests `is None`
    every_stage = parse_odb_arguments({"odb_enable": True, "odb_padding_free": True, "odb_balance": True,
                                       "odb_balance_stages": ["llm", "vision", "audio"]})
    assert model_refusal(every_stage, "gemma3") == "\n".join(
        [vision_stage_refusal("gemma3"), audio_stage_refusal("gemma3"), padding_free_refusal("gemma3")])


def test_the_unused_parameter_check_reads_llamafactorys_defaults():
    """Unset finetuning_type is LLaMA-Factory's lora (nothing of the tower trained) and unset
    disable_gradient_checkpointing leaves checkpointing on."""
    assert ddp_unused_parameter_problems({"freeze_vision_tower": False}, "qwen2_5_omni", 2) == []
    assert ddp_unused_parameter_problems(dict(OMNI_FULL, ddp_find_unused_parameters=True,
                                              disable_gradient_checkpointing=True), "qwen2_5_omni", 2) == []
    assert len(ddp_unused_parameter_problems(dict(OMNI_FULL, ddp_find_unused_parameters=True),
                                             "qwen2_5_omni", 2)) == 1


def test_missing_local_paths_are_named_and_hub_ids_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_paths({})                                                   # nothing set: LLaMA-Factory's to refuse
    check_paths({"model_name_or_path": "Qwen/Qwen3-VL-8B-Instruct"})  # a hub id
    check_paths({"dataset_dir": "ONLINE", "dataset": "alpaca"})       # LLaMA-Factory's hub datasets
    for missing in ("/absent/odb_model", "~/absent_odb_model", "./absent_odb_model"):
        with pytest.raises(FileNotFoundError, match=f"^model_name_or_path: {missing} does not exist$"):
            check_paths({"model_name_or_path": missing})
    with pytest.raises(FileNotFoundError, match="^dataset_dir: absent is not a directory$"):
        check_paths({"dataset_dir": "absent"})
    data = tmp_path / "data"
    data.mkdir()
    check_paths({"dataset_dir": str(data), "dataset": "alpaca"})      # no dataset_info.json: LLaMA-Factory's to read
    (data / "dataset_info.json").write_text(json.dumps({"alpaca": {}, "identity": {}}))
    check_paths({"dataset_dir": str(data)})                           # no dataset named
    check_paths({"dataset_dir": str(data), "dataset": "alpaca, identity"})
    with pytest.raises(ValueError, match=r"^dataset \['absent'\] not registered in .*dataset_info.json "
                                         r"\(known: \['alpaca', 'identity'\]\)$"):
        check_paths({"dataset_dir": str(data), "dataset": "alpaca,absent"})


def test_every_incompatible_setting_is_named_in_one_message():
    raw = {"use_dft_loss": True, "accelerator_config": {"dispatch_batches": True}, "streaming": True,
           "use_hyper_parallel": True, "use_kt": True, "tokenized_path": "cache", "group_by_length": True}
    with pytest.raises(ValueError) as refused:
        check_compatible(parse_odb_arguments({"odb_enable": True}), raw)
    assert str(refused.value) == "\n  - ".join([
        "incompatible settings with odb_enable: true:",
        "use_dft_loss: it replaces the loss function ODB weights to reproduce the fixed-batch loss; set "
        "odb_step: groups and odb_loss_scaling: none to keep it, or turn it off",
        "dispatch_batches: true: rank 0 would read and broadcast every batch, but ODB batches are formed per "
        "rank; set accelerator_config.dispatch_batches: false",
        "streaming: ODB needs a map-style dataset (views and resume are by index); set streaming: false",
        "use_hyper_parallel: hyper-parallel training runs its own trainer and data path, which ODB does not "
        "hook; remove the odb_* keys or turn use_hyper_parallel off",
        "use_kt: KTransformers training runs its own trainer and data path, which ODB does not hook; remove "
        "the odb_* keys or turn use_kt off",
        "tokenized_path: LLaMA-Factory would tokenize the whole dataset up front and save it, while ODB "
        "processes each sample lazily in its DataLoader workers; remove tokenized_path",
        "group_by_length sampling: ODB already groups by real length; use the default train_sampling_strategy"])
    # the suggested way to keep a replacement loss is accepted
    check_compatible(parse_odb_arguments({"odb_enable": True, "odb_step": "groups", "odb_loss_scaling": "none"}),
                     {"use_dft_loss": True, "use_eaft_loss": True, "use_asft_loss": True})


def test_packing_and_neat_packing_are_refused_with_the_way_out():
    message = ("packing/neat_packing: ODB forms token-budgeted groups itself (packing would re-batch its groups, "
               "and packing has open bugs with Qwen3-VL); set packing: false, and odb_padding_free: true to "
               "train each group without padding")
    assert packing_problem({"packing": True}) == packing_problem({"neat_packing": True}) == message
    assert packing_problem({"packing": False, "neat_packing": False}) is None and packing_problem({}) is None


def test_keys_that_decide_padding_free_before_the_model_is_known():
    def decided(**keys):
        odb = parse_odb_arguments({"odb_enable": True, **keys})
        return odb.padding_free, odb.padding_free_reason
    assert decided(odb_cost_mode="packed") == decided(odb_balance_mode="min_move") == (None, "")  # auto waits
    assert decided(odb_cost_mode="padded") == (False, "odb_cost_mode: padded asks for padded groups")
    assert decided(odb_balance=True, odb_balance_stages=["llm", "vision"]) == (
        False, "encoder-stage balancing (odb_balance_stages) runs on padded groups")
    assert parse_odb_arguments({"odb_padding_free_row_tokens": 1}).adapter.padding_free_row_tokens == 1
    with pytest.raises(ValueError, match="^odb_padding_free_row_tokens: 0 is below 1$"):
        parse_odb_arguments({"odb_padding_free_row_tokens": 0})
    with pytest.raises(ValueError, match=r"^odb_balance: 'maybe' is not a boolean .*, or auto \(the default\)$"):
        parse_odb_arguments({"odb_balance": "maybe"})


def test_what_the_installed_transformers_rules_out_is_named():
    every_stage = parse_odb_arguments({"odb_enable": True, "odb_balance": True,
                                       "odb_balance_stages": ["llm", "vision", "audio"]})
    assert version_problems(every_stage, {"flash_attn": "fa2", "include_tokens_per_second": True}, "4.40.0") == [
        "odb_balance_stages: [vision] runs inside the model's forward as transformers 4.57.1–4.57.6 and 5.6.0 "
        "write it; transformers 4.40.0 is installed. Use odb_balance_stages: [llm]",
        "odb_balance_stages: [audio] runs inside Qwen2.5-Omni's thinker as transformers 4.57.1–4.57.6 and "
        "5.6.0 write it; transformers 4.40.0 is installed. Remove audio from odb_balance_stages",
        "include_tokens_per_second: transformers 4.x counts the tokens by iterating the training loader once "
        "before training (a whole extra epoch of ODB's lazy pipeline, on every rank); use "
        "include_effective_tokens_per_second"]
    assert version_problems(every_stage, {"flash_attn": "fa3"}, "5.6.0") == [
        "flash_attn: fa3: transformers 5.6.0's flash attention fails on the first forward "
        "(flash_attention_forward calls s_aux.to() with s_aux None; 5.6.1 and later guard it, but "
        "LLaMA-Factory 0.9.5 accepts transformers up to 5.6.0); use flash_attn: sdpa (padding-free rows then "
        "attend per sample through sdpa), or transformers 4.57.6"]
    assert version_problems(every_stage, {"flash_attn": "sdpa", "include_tokens_per_second": True}, "5.6.0") == []


def test_each_refused_setting_alone_is_named():
    odb = parse_odb_arguments({"odb_enable": True})
    with pytest.raises(ValueError) as refused:
        check_compatible(odb, {"stage": "kto"})
    assert str(refused.value) == ("odb_enable: true applies to stage ['sft', 'pt', 'dpo']; this run has stage 'kto'. "
                                  "Set odb_enable: false (or remove the odb_* keys), or use stage: sft, pt or dpo")
    for loss in ("use_dft_loss", "use_eaft_loss", "use_asft_loss"):
        with pytest.raises(ValueError, match=f"^incompatible settings with odb_enable: true:\n  - {loss}: it replaces"):
            check_compatible(odb, {loss: True})
    with pytest.raises(ValueError, match="^incompatible settings with odb_enable: true:\n  - group_by_length sampling"):
        check_compatible(odb, {"train_sampling_strategy": "group_by_length"})   # transformers 5's spelling
    check_compatible(odb, {"train_sampling_strategy": "random"})


def test_odb_balance_exchanges_samples_in_the_loader_only_for_the_llm_stage():
    def balance(stages):
        return parse_odb_arguments({"odb_balance": True, "odb_balance_stages": stages}).config.balance
    assert balance(["llm"]) is True and balance(["llm", "vision"]) is True
    assert balance(["vision"]) is False
    assert parse_odb_arguments({"odb_balance": False, "odb_balance_stages": ["llm"]}).config.balance is False


def test_odb_balance_auto_post_balances_samples_mode_on_more_than_one_rank():
    def settled(world, **keys):
        odb = parse_odb_arguments({"odb_enable": True, **keys})
        explicit = keys.get("odb_balance", "auto")
        assert odb.value_of("odb_balance") == ("auto" if str(explicit).lower() == "auto" else explicit)
        on = odb.decide_balance(world)
        assert odb.decide_balance(1 if world > 1 else 4) is on, "decided once"
        assert odb.config.balance is on and odb.value_of("odb_balance") is on
        return on, odb.balance_reason
    assert settled(2) == (True, "odb_balance: auto, odb_step: samples on 2 ranks: each micro-step's samples "
                                "are re-dealt so the ranks carry even costs; the model is the same")
    assert settled(8, odb_balance="AUTO")[0] is True
    assert settled(1) == (False, "odb_balance: auto, one rank: nothing to re-deal")
    assert settled(2, odb_step="groups") == (
        False, "odb_balance: auto, odb_step: groups (set odb_balance: true to post-balance its groups)")
    assert settled(2, odb_balance_stages=["vision"]) == (
        False, "odb_balance: auto, odb_balance_stages leaves out llm")
    # an explicit value stands, and says nothing
    assert settled(2, odb_balance=False) == (False, "")
    assert settled(1, odb_balance=True) == (True, "")
    assert settled(2, odb_step="groups", odb_balance=True) == (True, "")
    # auto turns on the loader's exchange only: the encoder stages stay the explicit key's
    odb = parse_odb_arguments({"odb_enable": True, "odb_balance_stages": ["llm", "vision"]})
    assert odb.decide_balance(2) and not odb.vision_stage and odb.padding_free is None
