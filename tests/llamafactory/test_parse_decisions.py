"""What the argument parser decides from a recipe's keys and the model folder's config.json
alone (odb_factory.llamafactory.arguments), one process: stage pt's packing, the DDP setups
that would stop on Qwen2.5-Omni's unused audio embedding, and `odb_padding_free: auto`'s
choice with its reason."""

from __future__ import annotations

import itertools
import json

import pytest

from odb_factory.llamafactory.arguments import (check_model, ddp_unused_parameter_problems, parse_odb_arguments,
                                                stage_arguments)

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
