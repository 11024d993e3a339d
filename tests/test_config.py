"""ODBConfig is the single declaration of every option: the checks, the LLaMA-Factory keys
and the docs are derived from it, and values are typed on the way in."""

from __future__ import annotations

import dataclasses

import pytest

from odb_factory import ODBConfig
from odb_factory.config import OptionTypeError, lf_defaults, lf_keys
from odb_factory.llamafactory.arguments import (ADAPTER_KEYS, AdapterOptions, all_keys, parse_odb_arguments,
                                                split_odb_keys)

METADATA = {"doc", "agree", "lf_key", "lf_source", "choices", "minimum"}


@pytest.mark.parametrize("cls", [ODBConfig, AdapterOptions])
def test_every_field_is_declared_with_its_metadata(cls):
    for f in dataclasses.fields(cls):
        assert METADATA <= set(f.metadata), f"{cls.__name__}.{f.name} is not declared with option()"
        assert f.metadata["doc"].strip(), f"{cls.__name__}.{f.name} has no documentation"
        assert isinstance(f.metadata["agree"], bool)
        if f.metadata["lf_key"] is None:
            assert f.metadata["lf_source"], f"{f.name}: say where LLaMA-Factory takes its value from"


def test_yaml_keys_are_derived_from_the_declarations():
    engine = {f.name for f in dataclasses.fields(ODBConfig) if f.metadata["lf_key"] is not None}
    assert set(lf_keys().values()) == engine
    assert lf_keys()["sync_timeout"] == "sync_timeout_s"          # declared YAML names
    assert lf_keys()["collate_workers"] == "num_collate_workers"
    assert "seed" not in lf_keys() and "gradient_accumulation_steps" not in lf_keys()  # LLaMA-Factory's own
    assert not set(ADAPTER_KEYS) & set(lf_keys()), "an adapter option shadows an engine option"
    assert sorted(all_keys()) == sorted("odb_" + k for k in list(ADAPTER_KEYS) + list(lf_keys()))
    assert lf_defaults() == {"token_budget": "auto", "num_collate_workers": 1, "step_mode": "samples",
                             "loss_scaling": "standard", "balance": "auto"}


def test_rank_agreement_and_resume_checks_cover_the_declared_fields():
    agreed = {f.name for f in dataclasses.fields(ODBConfig) if f.metadata["agree"]}
    assert set(ODBConfig().planning_fields()) == agreed
    # options that change planning or counting must agree; per-process resources need not
    assert {"token_budget", "outstanding_depth", "pad_epoch_to_accumulation", "label_shift",
            "vision_token_ids", "ranks_per_node"} <= agreed
    assert not {"num_workers", "num_collate_workers", "sync_timeout_s", "prefetch_factor"} & agreed


@pytest.mark.parametrize("field,value,message", [
    ("token_budget", 0, "token_budget .* must be >= 1, got 0"),
    ("token_budget", "4096", "token_budget .* must be an integer, got '4096'"),
    ("join", "false", r"join .* must be a boolean \(true/false\), got 'false'"),
    ("cost_mode", "padding", r"cost_mode .* must be one of \['padded', 'packed'\]"),
    ("quota", 0, "quota .* must be >= 1"),
    ("sync_timeout_s", 0, "must be > 0 seconds"),
    ("num_workers", -1, "num_workers must be >= 0"),
    ("balance_tolerance", True, "balance_tolerance .* must be a number"),
])
def test_python_construction_is_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        ODBConfig(**{field: value})


def test_from_dict_converts_strings_and_names_bad_values():
    cfg = ODBConfig.from_dict({"token_budget": "512", "join": "false", "vision_token_ids": [5, 6]})
    assert (cfg.token_budget, cfg.join, cfg.vision_token_ids) == (512, False, (5, 6))
    with pytest.raises(OptionTypeError, match="token_budget: '4k' is not an integer"):
        ODBConfig.from_dict({"token_budget": "4k"})
    with pytest.raises(ValueError, match="did you mean 'token_budget'"):
        ODBConfig.from_dict({"token_budgte": 100})


@pytest.mark.parametrize("values,message", [
    ({"odb_enable": "ture"}, "odb_enable: 'ture' is not a boolean"),
    ({"odb_token_budget": "4k"}, "odb_token_budget: '4k' is not an integer"),
    ({"odb_sync_timeout": "soon"}, "odb_sync_timeout: 'soon' is not a number"),
    ({"odb_collate_workers": -1}, r"num_collate_workers \(YAML key odb_collate_workers\) must be >= 0"),
    ({"odb_balance_stages": ["llm", "speech"]}, "odb_balance_stages: 'speech' is not one of"),
    ({"odb_balance_mode": "greedy"}, r"balance_mode \(YAML key odb_balance_mode\) must be one of"),
])
def test_yaml_values_are_typed_and_named(values, message):
    with pytest.raises(ValueError, match=message):
        parse_odb_arguments(values)


def test_yaml_strings_become_their_types_and_adapter_defaults_apply():
    run = parse_odb_arguments({"odb_enable": "true", "odb_step": "groups", "odb_join": "false", "odb_token_budget": "8192",
                               "odb_sync_timeout": "60"})
    assert run.adapter.enable is True and run.config.join is False
    assert run.config.token_budget == 8192 and run.config.sync_timeout_s == 60.0
    assert run.config.num_collate_workers == 1            # the adapter's declared default
    assert run.value_of("odb_collate_workers") == 1 and run.value_of("odb_enable") is True


@pytest.mark.parametrize("keys, on_cpu, budget, reason", [
    ({}, True, 1024, "odb_step: samples on CPU"),
    ({"odb_token_budget": "AUTO"}, True, 1024, "odb_step: samples on CPU"),
    ({}, False, 4096, "odb_step: samples on an accelerator"),
    ({"odb_step": "groups"}, True, 4096, "odb_step: groups (the budget makes the optimizer steps"),
    ({"odb_token_budget": 2048}, True, 2048, ""),
    ({"odb_token_budget": "8192", "odb_step": "groups"}, False, 8192, ""),
])
def test_token_budget_auto_follows_the_device_only_in_samples_mode(keys, on_cpu, budget, reason):
    run = parse_odb_arguments({"odb_enable": True, **keys})
    explicit = "odb_token_budget" in keys and str(keys["odb_token_budget"]).lower() != "auto"
    assert run.value_of("odb_token_budget") == (budget if explicit else "auto")
    assert run.decide_token_budget(on_cpu) == budget == run.config.token_budget
    assert run.value_of("odb_token_budget") == budget
    assert reason in run.token_budget_reason and bool(run.token_budget_reason) == (not explicit)
    assert run.decide_token_budget(not on_cpu) == budget  # settled once


def test_unknown_yaml_key_names_the_closest():
    with pytest.raises(ValueError, match="did you mean 'odb_sync_timeout'"):
        split_odb_keys({"odb_sync_timout": 5})
