"""What each supported transformers version rules out, decided at parse time (pure checks;
the end-to-end tests run on both ends of the range: `make test` on the default pin and
`make test-transformers-4.57`)."""

from __future__ import annotations

import pytest

pytest.importorskip("llamafactory")

from odb_factory.llamafactory.arguments import parse_odb_arguments, version_problems  # noqa: E402


def _problems(raw_odb, raw, version):
    return version_problems(parse_odb_arguments({"odb_enable": True, **raw_odb}), raw, version)


@pytest.mark.parametrize("attention", ["fa2", "fa3"])
def test_flash_attention_is_refused_where_it_is_broken(attention):
    (problem,) = _problems({}, {"flash_attn": attention}, "5.6.0")
    assert problem.startswith(f"flash_attn: {attention}: transformers 5.6.0's flash attention fails on "
                              "the first forward"), problem
    assert _problems({}, {"flash_attn": attention}, "4.57.6") == []
    assert _problems({}, {"flash_attn": "sdpa"}, "5.6.0") == []


def test_vision_stage_needs_the_transformers_it_was_written_for():
    vision = {"odb_balance": True, "odb_balance_stages": ["llm", "vision"]}
    assert _problems(vision, {}, "5.6.0") == [] and _problems(vision, {}, "4.57.6") == []
    (problem,) = _problems(vision, {}, "5.3.0")
    assert "transformers 5.3.0 is installed. Use odb_balance_stages: [llm]" in problem
    assert _problems({"odb_balance": True, "odb_balance_stages": ["llm"]}, {}, "5.3.0") == []


def test_token_counting_that_would_replay_an_epoch_is_refused_on_4_57():
    (problem,) = _problems({}, {"include_tokens_per_second": True}, "4.57.6")
    assert "use include_effective_tokens_per_second" in problem
    assert _problems({}, {"include_tokens_per_second": True}, "5.6.0") == []


def test_the_installed_version_is_checked_when_a_run_is_parsed(tmp_path, tiny_model, demo_data):
    import transformers

    import llamafactory.train.tuner  # noqa: F401  (the import hook applies the patches)
    import odb_factory_patches
    from llamafactory.hparams import get_train_args

    from tests.helpers.lf_runs import base_yaml
    odb_factory_patches.apply()
    config = base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True, flash_attn="fa2")
    if transformers.__version__ == "5.6.0":
        with pytest.raises(ValueError, match="flash_attn: fa2: transformers 5.6.0's flash attention"):
            get_train_args(config)
    else:
        pytest.skip(f"flash attention is not known broken on transformers {transformers.__version__}")
