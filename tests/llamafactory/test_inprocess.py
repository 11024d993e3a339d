"""In-process checks of the LLaMA-Factory integration: lazy preprocessing is identical to
upstream's, and bad input fails before any process group starts."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llamafactory")

from tests.helpers import lf_runs  # noqa: E402
from tests.helpers.lf_runs import base_yaml  # noqa: E402


def _datasets(lf, config):
    return lf_runs.lazy_and_eager(lf, config)


def _assert_identical(lazy, eager):
    from odb_factory.llamafactory.lazy_dataset import LazySupervisedDataset
    assert isinstance(lazy, LazySupervisedDataset)
    assert len(lazy) == len(eager) > 0
    for outside in (len(lazy), -1):   # no wrap-around: an ODB index past the rows is a bug upstream of it
        with pytest.raises(IndexError, match=f"^{outside}$"):
            lazy[outside]
    for i in range(len(eager)):
        a, b = lazy[i], eager[i]
        assert a["input_ids"] == b["input_ids"], i
        assert a["labels"] == b["labels"], i
        assert a["attention_mask"] == b["attention_mask"], i
        assert (a.get("images") or None) == (b.get("images") or None), i


def test_lazy_equals_eager_on_generated_multimodal_data(lf, tmp_path, tiny_model, demo_data):
    config = base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True, cutoff_len=256)
    _assert_identical(*_datasets(lf, config))


def _rows_losing_image_tokens(lf, tmp_path, tiny_model, demo_data, monkeypatch):
    """(lazy dataset at cutoff_len=128, indices whose image tokens upstream's own output cuts)."""
    from odb_factory.llamafactory import cutoff_preflight
    with monkeypatch.context() as patch:  # the per-row check alone
        patch.setattr(cutoff_preflight, "check_cutoff", lambda lazy: None)
        lazy, eager = _datasets(lf, base_yaml(tiny_model, demo_data, tmp_path / "a", odb_enable=True,
                                              cutoff_len=128))
        full, _ = _datasets(lf, base_yaml(tiny_model, demo_data, tmp_path / "b", odb_enable=True,
                                          cutoff_len=4096))
    image_id = json.loads((tiny_model / "config.json").read_text())["image_token_id"]
    cut = [i for i in range(len(eager))
           if eager[i]["input_ids"].count(image_id) != full[i]["input_ids"].count(image_id)]
    return lazy, eager, cut


def test_truncated_vision_tokens_are_named(lf, tmp_path, tiny_model, demo_data, monkeypatch):
    from odb_factory.llamafactory.lazy_dataset import TruncatedVisionTokensError
    lazy, eager, cut = _rows_losing_image_tokens(lf, tmp_path, tiny_model, demo_data, monkeypatch)
    for i in range(len(eager)):
        if i in cut:
            with pytest.raises(TruncatedVisionTokensError) as caught:
                lazy[i]
            message = str(caught.value)
            assert message.startswith(f"training row {lazy.rows[i]}: cutoff_len=128 cuts into its image tokens (kept ")
            assert message.endswith("and the model cannot train on a partial image. Raise cutoff_len, "
                                    "lower image_max_pixels, or remove the row.")
        else:
            assert lazy[i]["input_ids"] == eager[i]["input_ids"]
    assert 0 < len(cut) < len(eager)


def test_rows_cutoff_len_would_cut_are_found_before_training(lf, tmp_path, tiny_model, demo_data,
                                                            monkeypatch):
    from odb_factory.llamafactory import cutoff_preflight
    from odb_factory.llamafactory.lazy_dataset import TruncatedVisionTokensError
    lazy, eager, cut = _rows_losing_image_tokens(lf, tmp_path, tiny_model, demo_data, monkeypatch)
    report = cutoff_preflight.find_cut_rows(lazy)
    assert len(report.cut) == len(cut) and report.candidates < len(lazy), report.candidates
    with pytest.raises(TruncatedVisionTokensError) as info:
        _datasets(lf, base_yaml(tiny_model, demo_data, tmp_path / "c", odb_enable=True, cutoff_len=128))
    text = str(info.value)
    assert text.startswith(f"{len(cut)} training row(s) would lose image/video/audio tokens to cutoff_len=128 "
                           "(found before training; "), text
    assert f"  training row {lazy.rows[cut[0]]}: cutoff_len=128 cuts into its image tokens" in text, text
    # the bound never misses a row the pipeline cuts: every cut row was a candidate
    bounds = cutoff_preflight.vision_token_bounds(lazy.processor.processor)
    columns = lazy.converted.to_dict()
    upper = cutoff_preflight.token_upper_bounds(columns, bounds)
    full_lengths = [len(s["input_ids"]) for s in
                    _datasets(lf, base_yaml(tiny_model, demo_data, tmp_path / "d", odb_enable=True,
                                            cutoff_len=100000))[1]]
    assert all(upper[lazy.rows[i]] >= full_lengths[i] for i in range(len(lazy))), "a bound below the real length"


def test_rows_whose_image_outgrows_the_text_allowance_are_found_before_training(lf, tmp_path, tiny_model):
    """Short text, a large image: only the image's bound, at the run's own pixel limit (which
    LLaMA-Factory keeps on the processor), can make such a row a candidate."""
    from PIL import Image

    from odb_factory.llamafactory import cutoff_preflight
    from odb_factory.llamafactory.lazy_dataset import TruncatedVisionTokensError
    data = tmp_path / "large_images"
    data.mkdir()
    rows = []
    for i in range(3):
        Image.new("RGB", (512, 512), (40 * i, 90, 200)).save(data / f"large{i}.png")
        rows.append({"messages": [{"role": "user", "content": "<image>Colour?"},
                                  {"role": "assistant", "content": "Blue."}], "images": [f"large{i}.png"]})
    (data / "large.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"large": {
        "file_name": "large.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    config = base_yaml(tiny_model, data, tmp_path / "out", odb_enable=True, dataset="large", media_dir=str(data),
                       image_max_pixels=512 * 512, cutoff_len=200)  # 256 image tokens a row: each is cut
    with pytest.raises(TruncatedVisionTokensError, match=r"^3 training row\(s\) would lose image/video/audio "
                                                         r"tokens to cutoff_len=200 \(found before training; 3 of 3"):
        _datasets(lf, config)
    processor = lf[1](lf[0](config)[0])["processor"]
    bounds = cutoff_preflight.vision_token_bounds(processor)
    # 512x512 pixels at 32x32 pixels a token: 256 tiles + 14.21 x 16 for the sides' rounding at
    # any shape, rounded up, + 1, + 2 markers
    assert bounds.per_image == 484 + 1 + 2


@pytest.mark.skipif(not lf_runs.SHARED_DEMO.exists(), reason="shared LLaMA-Factory demo data is absent")
def test_lazy_equals_eager_on_real_demo_data(lf, tmp_path, tiny_model):
    demo = lf_runs.SHARED_DEMO
    data_dir = tmp_path / "real"
    data_dir.mkdir()
    (data_dir / "dataset_info.json").write_text(json.dumps({
        "alpaca_en_demo": {"file_name": str(demo / "alpaca_en_demo.json")},
        "glaive_toolcall_en_demo": {"file_name": str(demo / "glaive_toolcall_en_demo.json"),
                                    "formatting": "sharegpt",
                                    "columns": {"messages": "conversations", "tools": "tools"}},
        "mllm_demo": {"file_name": str(demo / "mllm_demo.json"), "formatting": "sharegpt",
                      "columns": {"messages": "messages", "images": "images"},
                      "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                               "assistant_tag": "assistant"}}}))
    config = base_yaml(tiny_model, data_dir, tmp_path / "out", media_dir=str(demo), odb_enable=True,
                       dataset="mllm_demo,alpaca_en_demo,glaive_toolcall_en_demo", max_samples=80,
                       cutoff_len=256)  # truncates long text rows; no image run is cut at 256
    lazy, eager = _datasets(lf, config)
    _assert_identical(lazy, eager)
    assert any(len(eager[i]["input_ids"]) == 256 for i in range(len(eager))), "truncation is exercised"


@pytest.mark.parametrize("change,message", [
    ({"odb_token_budgte": 10}, "did you mean 'odb_token_budget'"),
    ({"odb_token_budget": 0}, "ODBConfig.token_budget (YAML key odb_token_budget) must be >= 1, got 0"),
    ({"odb_token_budget": "4k"}, "odb_token_budget: '4k' is not an integer"),
    ({"odb_enable": "ture"}, "odb_enable: 'ture' is not a boolean"),
    ({"odb_balance_mode": "greedy"}, "(YAML key odb_balance_mode) must be one of ['padded', 'lpt', 'min_move'], got 'greedy'"),
    ({"stage": "kto"}, "odb_enable: true applies to stage ['sft', 'pt', 'dpo']; this run has stage 'kto'"),
    ({"packing": True}, "packing/neat_packing"),
    ({"use_dft_loss": True}, "use_dft_loss"),
    ({"streaming": True}, "streaming: ODB needs a map-style dataset"),
    ({"accelerator_config": {"dispatch_batches": True}}, "dispatch_batches"),
    ({"tokenized_path": "tokenized"}, "tokenized_path: LLaMA-Factory would tokenize the whole dataset"),
    ({"use_hyper_parallel": True}, "use_hyper_parallel: hyper-parallel training runs its own trainer"),
    ({"use_kt": True}, "use_kt: KTransformers training runs its own trainer"),
])
def test_bad_odb_settings_are_named(lf, tmp_path, tiny_model, demo_data, change, message):
    config = base_yaml(tiny_model, demo_data, tmp_path / "out", **{"odb_enable": True, **change})
    with pytest.raises(ValueError) as info:
        lf[0](config)
    assert message in str(info.value)


def test_missing_and_unreadable_media_are_found_before_training(lf, tmp_path, tiny_model, demo_data):
    import shutil
    from odb_factory.llamafactory.preflight import MediaFileError
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    rows = json.loads((data / "demo.json").read_text())
    missing, broken = rows[3]["images"][1], rows[4]["images"][0]
    (data / missing).unlink()
    (data / broken).write_bytes(b"not a png at all")
    config = base_yaml(tiny_model, data, tmp_path / "out", odb_enable=True)
    with pytest.raises(MediaFileError) as info:
        _datasets(lf, config)
    text = str(info.value)
    assert text.startswith("2 training row(s) name 2 media file(s) that cannot be used (found before "
                           "training; "), text
    # LLaMA-Factory keeps a path it could not resolve as it was written
    assert f"training row 3: image {missing} does not exist" in text, text
    assert f"training row 4: image {data / broken} cannot be read (UnidentifiedImageError" in text, text


def test_vision_stage_on_a_text_model_is_refused_at_parse_time(lf, tmp_path, tiny_model, demo_data):
    from odb_factory.demo.tiny_qwen3 import build_tiny_qwen3
    model = build_tiny_qwen3(tmp_path / "tiny_qwen3", seed=0)
    config = base_yaml(model, demo_data, tmp_path / "out", odb_enable=True, odb_balance=True,
                       odb_balance_stages=["llm", "vision"])
    with pytest.raises(ValueError, match=r"^odb_balance_stages: \[vision\] supports Qwen3-VL and Qwen2.5-Omni models; "
                                         r"this model is 'qwen3'\. Use odb_balance_stages: \[llm\]$"):
        lf[0](config)


def test_audio_stage_on_a_vision_model_is_refused_at_parse_time(lf, tmp_path, tiny_model, demo_data):
    from odb_factory.llamafactory.arguments import audio_stage_refusal
    config = base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True, odb_balance=True,
                       odb_balance_stages=["llm", "audio"])
    with pytest.raises(ValueError, match=r"^odb_balance_stages: \[audio\] supports Qwen2.5-Omni models; "
                                         r"this model is 'qwen3_vl'\. Remove audio from odb_balance_stages$"):
        lf[0](config)
    assert audio_stage_refusal("qwen3_omni_moe") == (
        "odb_balance_stages: [audio]: Qwen3-Omni's audio tower attends across the clips of one call under sdpa "
        "(it builds no mask between them), so encoding a clip beside other ranks' clips would change its "
        "embeddings. Remove audio from odb_balance_stages")
    assert audio_stage_refusal("qwen2_5_omni") is None


def _odb_options(parsed):
    from odb_factory.llamafactory.run import run_of
    return run_of(parsed[1]).options


def test_padding_free_sets_its_costs_and_refuses_contradictions(lf, tmp_path, tiny_model, demo_data):
    odb = _odb_options(lf[0](base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True,
                                       odb_padding_free=True)))
    assert odb.adapter.padding_free == "true" and odb.padding_free is True
    assert (odb.config.cost_mode, odb.config.balance_mode) == ("packed", "lpt")
    odb = _odb_options(lf[0](base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True,
                                       odb_padding_free=True, odb_balance_mode="min_move")))
    assert odb.config.balance_mode == "min_move"
    with pytest.raises(ValueError, match=r"^odb_cost_mode: padded contradicts odb_padding_free: true .* "
                                         r"remove odb_cost_mode or set it to packed$"):
        lf[0](base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True, odb_padding_free=True,
                        odb_cost_mode="padded"))
    with pytest.raises(ValueError, match=r"^odb_balance_mode: padded contradicts odb_padding_free: true"):
        lf[0](base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True, odb_padding_free=True,
                        odb_balance_mode="padded"))
    with pytest.raises(ValueError, match=r"^odb_padding_free_row_tokens applies to padding-free groups; set "
                                         r"odb_padding_free: true or remove it$"):
        lf[0](base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True, odb_padding_free=False,
                        odb_padding_free_row_tokens=256))
    with pytest.raises(ValueError, match=r"^odb_padding_free_row_tokens: 0 is below 1$"):
        lf[0](base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True, odb_padding_free=True,
                        odb_padding_free_row_tokens=0))


def test_padding_free_auto_decides_by_model_and_keys(lf, tmp_path, tiny_model, demo_data):
    """`odb_padding_free: auto` (the default): padding-free for a verified model, with the costs
    it implies; padded groups where a key or the model rules it out, each with its reason."""
    import shutil

    def decided(model=tiny_model, **keys):
        odb = _odb_options(lf[0](base_yaml(model, demo_data, tmp_path / "out", odb_enable=True, **keys)))
        return odb.padding_free, odb.config.cost_mode, odb.padding_free_reason

    assert decided()[:2] == (True, "packed") and "'qwen3_vl' trains packed rows" in decided()[2]
    assert decided(odb_padding_free="auto")[:2] == (True, "packed")
    assert decided(odb_padding_free=False) == (False, "padded", "odb_padding_free: false")
    assert decided(odb_cost_mode="padded") == (False, "padded", "odb_cost_mode: padded asks for padded groups")
    assert decided(odb_balance=True, odb_balance_stages=["llm", "vision"])[:2] == (False, "padded")
    mask = decided(odb_packed_attention="mask")
    assert mask[:2] == (False, "padded") and "dense (Σ len)² mask" in mask[2]
    assert decided(odb_padding_free=True, odb_packed_attention="mask")[:2] == (True, "packed")
    other = tmp_path / "other_model"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, model_type="qwen2_vl")))
    assert decided(other) == (False, "padded", "model type 'qwen2_vl' is not verified for packed rows")
    def options(**keys):
        return _odb_options(lf[0](base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True, **keys)))
    # the costs a padding-free group implies: packed, balanced by Σ g(len) (min_move kept)
    assert (options().config.cost_mode, options().config.balance_mode) == ("packed", "lpt")
    assert options(odb_balance_mode="min_move").config.balance_mode == "min_move"
    assert options(odb_padding_free=False).config.balance_mode == "padded"
    # the value each key was given, as a recipe would write it back
    assert [options(**({} if v is None else {"odb_padding_free": v})).value_of("odb_padding_free")
            for v in (None, True, False)] == ["auto", True, False]
    assert options(odb_balance=True, odb_balance_stages=["vision"]).value_of("odb_balance") is True
    assert options(odb_balance=True, odb_balance_stages=["vision"]).config.balance is False  # no llm stage
    assert options().value_of("odb_balance") == "auto" and options(odb_balance=False).value_of("odb_balance") is False
    with pytest.raises(ValueError, match=r"^odb_padding_free: 'maybe' is not one of \['auto', 'true', 'false'\]$"):
        decided(odb_padding_free="maybe")
    with pytest.raises(ValueError, match=r"^odb_packed_attention: 'dense' is not one of \['segments', 'mask'\]$"):
        decided(odb_packed_attention="dense")


def test_padding_free_on_an_unverified_model_is_refused_at_parse_time(lf, tmp_path, tiny_model, demo_data):
    import shutil
    model = tmp_path / "other_model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, model_type="qwen2_vl")))
    with pytest.raises(ValueError, match=r"^odb_padding_free: true: packed rows are verified for \['llama', "
                                         r"'qwen2_5_vl', 'qwen3', 'qwen3_vl'\]; this model is 'qwen2_vl' .* "
                                         r"Set odb_padding_free: false$"):
        lf[0](base_yaml(model, demo_data, tmp_path / "out", odb_enable=True, odb_padding_free=True))


def test_megatron_core_runs_refuse_odb_keys(lf, tmp_path, tiny_model, demo_data, monkeypatch):
    monkeypatch.setenv("USE_MCA", "1")
    config = base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True)
    with pytest.raises(ValueError, match=r"odb_\* keys with USE_MCA=1: Megatron-Core \(MCA\) training runs"):
        lf[0](config)


def test_missing_paths_are_named(lf, tmp_path, tiny_model, demo_data):
    with pytest.raises(FileNotFoundError, match="model_name_or_path: ./no/such/model does not exist"):
        lf[0](base_yaml("./no/such/model", demo_data, tmp_path / "o", odb_enable=True))
    with pytest.raises(FileNotFoundError, match="dataset_dir: .* is not a directory"):
        lf[0](base_yaml(tiny_model, tmp_path / "nothing", tmp_path / "o", odb_enable=True))
    with pytest.raises(ValueError, match=r"dataset \['nope'\] not registered"):
        lf[0](base_yaml(tiny_model, demo_data, tmp_path / "o", odb_enable=True, dataset="nope"))


def test_command_line_overrides_reach_odb(lf, tmp_path, tiny_model, demo_data, monkeypatch):
    import sys
    import yaml
    from llamafactory.hparams.parser import read_args
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(base_yaml(tiny_model, demo_data, tmp_path / "o", odb_enable=True,
                                             odb_step="groups")))
    monkeypatch.setattr(sys, "argv", ["x", str(path), "odb_token_budget=8192", "odb_join=false"])
    odb = _odb_options(lf[0](read_args()))
    assert odb.config.token_budget == 8192 and odb.config.join is False


def test_hook_costs_nothing_in_other_processes():
    import subprocess
    import sys
    code = "import sys; print('torch' in sys.modules, 'llamafactory' in sys.modules, " \
           "any(type(f).__name__ == 'PatchOnImport' for f in sys.meta_path))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True"]


def test_unsupported_versions_are_named(monkeypatch):
    import llamafactory
    import transformers
    import odb_factory_patches
    assert odb_factory_patches.unsupported_reason() is None
    monkeypatch.setattr(llamafactory, "__version__", "0.9.4")
    assert "llamafactory 0.9.4 is installed" in odb_factory_patches.unsupported_reason()
    monkeypatch.setattr(llamafactory, "__version__", "0.9.5")
    for supported in ("4.57.1", "4.57.6", "5.6.0"):
        monkeypatch.setattr(transformers, "__version__", supported)
        assert odb_factory_patches.unsupported_reason() is None
    for unsupported in ("4.56.2", "4.57.0", "4.58.0", "5.7.0"):
        monkeypatch.setattr(transformers, "__version__", unsupported)
        assert f"transformers {unsupported} is installed" in odb_factory_patches.unsupported_reason()


def test_supervised_logits_need_a_forward_that_takes_logits_to_keep():
    """`odb_supervised_logits` applies where the model's forward (a PEFT model's base model's)
    takes `logits_to_keep`; the Omni thinker's does not, and computes every position."""
    import inspect
    import logging

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration

    from odb_factory.llamafactory.trainer import takes_logits_to_keep
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert takes_logits_to_keep(llama)
    peft = get_peft_model(llama, LoraConfig(r=2, target_modules=["q_proj"]))
    assert "logits_to_keep" not in inspect.signature(peft.forward).parameters
    assert takes_logits_to_keep(peft)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert peft(input_ids=ids, logits_to_keep=torch.tensor([1, 3])).logits.shape == (1, 2, 64)
    # not initialised: only its forward's signature is read
    thinker = Qwen2_5OmniThinkerForConditionalGeneration.__new__(Qwen2_5OmniThinkerForConditionalGeneration)
    assert not takes_logits_to_keep(thinker)
    assert not takes_logits_to_keep(torch.nn.Linear(2, 2))
    # the trainer's choice: the key, then the model; the start-up log names a model that cannot
    from types import SimpleNamespace

    from odb_factory.llamafactory.trainer import ODBTrainerMixin

    def chosen(enabled, model):
        trainer = SimpleNamespace(_odb=SimpleNamespace(adapter=SimpleNamespace(supervised_logits=enabled)))
        return ODBTrainerMixin._odb_choose_supervised_logits(trainer, model)
    assert chosen(True, llama) and chosen(True, peft) and not chosen(False, llama) and not chosen(True, None)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    odb_logger = logging.getLogger("odb_factory")
    odb_logger.addHandler(handler)
    level = odb_logger.level
    odb_logger.setLevel(logging.INFO)
    try:
        assert not chosen(True, thinker)
    finally:
        odb_logger.removeHandler(handler)
        odb_logger.setLevel(level)
    assert [r.getMessage() for r in records] == [
        "ODB: logits at every position (Qwen2_5OmniThinkerForConditionalGeneration.forward takes no logits_to_keep)"]


def test_which_training_batches_compute_the_supervised_logits_only():
    """The trainer's one decision, which its loss and bench.cpu_layer's step records both read:
    a `samples`-mode micro-batch (it carries its sample weights), or a `groups`-mode one whose
    loss is the window's token sum; not LLaMA-Factory's own loss (`odb_loss_scaling: none`), not
    without labels, not with `odb_supervised_logits` off or unavailable."""
    from types import SimpleNamespace

    from odb_factory.llamafactory.trainer import ODBTrainerMixin

    def window_loss(*args):
        return None

    def keeps(batch, enabled=True, loss=window_loss):
        trainer = SimpleNamespace(_odb_supervised_logits=enabled, compute_loss_func=loss,
                                  _odb_window_loss=window_loss)
        return ODBTrainerMixin._odb_keeps_supervised_logits(trainer, batch)
    samples, groups = {"labels": 1, "odb_sample_weights": 1}, {"labels": 1}
    assert keeps(samples) and keeps(groups)
    assert keeps(samples, loss=None) and not keeps(groups, loss=None)
    assert not keeps(samples, enabled=False) and not keeps(groups, enabled=False)
    assert not keeps({"odb_sample_weights": 1}) and not keeps({})


def _image_rows(data, n, system="", tools=""):
    """`n` sharegpt rows of a short question about a small image, with `system` and `tools`."""
    from PIL import Image
    data.mkdir(exist_ok=True)
    rows = []
    for i in range(n):
        Image.new("RGB", (64, 64), (40 * i % 255, 90, 200)).save(data / f"small{i}.png")
        rows.append({"messages": [{"role": "user", "content": "<image>Colour?"},
                                  {"role": "assistant", "content": "Blue."}],
                     "images": [f"small{i}.png"], "system": system if i % 2 else "", "tools": tools if i % 2 else ""})
    (data / "rows.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"rows": {
        "file_name": "rows.json", "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images", "system": "system", "tools": "tools"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))


@pytest.mark.parametrize("column", ["system", "tools"])
def test_a_rows_system_prompt_and_tools_count_toward_its_bound(lf, tmp_path, tiny_model, monkeypatch, column):
    """Rows alike but for a 400-byte system prompt or a tool's description on every second row, and
    cutoff_len just above the bound of a row without it: exactly the rows with it are run
    through the pipeline."""
    from odb_factory.llamafactory import cutoff_preflight
    data = tmp_path / "rows"
    tool = {"name": "colour_of", "description": "The colour of an image. " * 12,
            "parameters": {"type": "object", "properties": {"image": {"type": "string"}}}}
    _image_rows(data, 6, **{column: "x" * 400 if column == "system" else json.dumps([tool])})
    config = base_yaml(tiny_model, data, tmp_path / "out", odb_enable=True, dataset="rows", media_dir=str(data))
    with monkeypatch.context() as patch:  # the lazy dataset only
        patch.setattr(cutoff_preflight, "check_cutoff", lambda lazy: None)
        lazy, _ = _datasets(lf, config)
    bounds = cutoff_preflight.vision_token_bounds(lazy.processor.processor)
    plain, longer = cutoff_preflight.token_upper_bounds(lazy.converted.to_dict(), bounds)[:2]
    lazy.processor.data_args.cutoff_len = plain + 1
    report = cutoff_preflight.find_cut_rows(lazy, threads=1)
    assert report.candidates == 3
    lazy.processor.data_args.cutoff_len = longer   # a bound that reaches cutoff_len exactly counts
    assert cutoff_preflight.find_cut_rows(lazy, threads=1).candidates == 3
    # the pipeline decides which of those it cuts (a tool list is templated at length)
    assert {message.split(":")[0] for message in report.cut} <= {f"training row {i}" for i in (1, 3, 5)}


@pytest.mark.parametrize("rows", [5, 7])
def test_the_cutoff_error_lists_five_rows_and_counts_the_rest(lf, tmp_path, tiny_model, rows):
    from odb_factory.llamafactory.lazy_dataset import TruncatedVisionTokensError
    data = tmp_path / "rows"
    _image_rows(data, rows)
    config = base_yaml(tiny_model, data, tmp_path / "out", odb_enable=True, dataset="rows", media_dir=str(data),
                       cutoff_len=6)   # the answer keeps 4 tokens, the prompt 2: no image token
    with pytest.raises(TruncatedVisionTokensError) as caught:
        _datasets(lf, config)
    lines = str(caught.value).splitlines()
    assert lines[0] == (f"{rows} training row(s) would lose image/video/audio tokens to cutoff_len=6 (found before "
                        f"training; {rows} of {rows} rows could reach it and were run through the pipeline):")
    assert [line.split(":")[0] for line in lines[1:6]] == [f"  training row {i}" for i in range(5)]
    assert all(line.startswith(f"  training row {i}: cutoff_len=6 cuts into its image tokens (kept ")
               and line.endswith(", and the model cannot train on a partial image") for i, line in enumerate(lines[1:6]))
    assert lines[6:] == (["  ... and 2 more"] if rows > 5 else []) + [
        "Raise cutoff_len, lower image_max_pixels/video_max_pixels, shorten the audio, or remove "
        "the rows; the run would otherwise fail when it reached them."]


def test_video_rows_cutoff_len_would_cut_are_found_before_training(lf, tmp_path, tiny_model, monkeypatch):
    """A row whose only media is a video (a list of frame files) is a candidate, and the
    pipeline names the video tokens cutoff_len cuts."""
    from PIL import Image

    from odb_factory.llamafactory.lazy_dataset import TruncatedVisionTokensError
    data = tmp_path / "videos"
    data.mkdir()
    rows = []
    for i in range(2):
        frames = []
        for f in range(4):
            Image.new("RGB", (64, 64), (60 * f, 30 * i, 200)).save(data / f"v{i}_{f}.png")
            frames.append(f"v{i}_{f}.png")
        rows.append({"messages": [{"role": "user", "content": "<video>What moves?"},
                                  {"role": "assistant", "content": "A square."}], "videos": [frames]})
    (data / "rows.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"rows": {
        "file_name": "rows.json", "formatting": "sharegpt", "columns": {"messages": "messages", "videos": "videos"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    config = base_yaml(tiny_model, data, tmp_path / "out", odb_enable=True, dataset="rows", media_dir=str(data),
                       cutoff_len=8)
    with pytest.raises(TruncatedVisionTokensError) as caught:
        _datasets(lf, config)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("2 training row(s) would lose image/video/audio tokens to cutoff_len=8 (found "
                               "before training; 2 of 2 rows could reach it"), lines
    assert [line.split(" (kept ")[0] for line in lines[1:3]] == [
        f"  training row {i}: cutoff_len=8 cuts into its video tokens" for i in range(2)]
    _assert_the_row_names_its_remedy(lf, config, monkeypatch, 0, "video", "lower video_max_pixels")


def _assert_the_row_names_its_remedy(lf, config, monkeypatch, row, what, remedy):
    """The lazy check's own message for training row `row` (the pre-flight off), which says
    what to change. (The data loader prints the first sample: that is where a cut row 0 fails.)"""
    from odb_factory.llamafactory import cutoff_preflight
    from odb_factory.llamafactory.lazy_dataset import TruncatedVisionTokensError
    with monkeypatch.context() as patch, pytest.raises(TruncatedVisionTokensError) as caught:
        patch.setattr(cutoff_preflight, "check_cutoff", lambda lazy: None)
        lazy, _ = _datasets(lf, config)
        lazy[lazy.rows.index(row)]
    message = str(caught.value)
    assert message.startswith(f"training row {row}: cutoff_len={config['cutoff_len']} cuts into its {what} tokens "
                              "(kept ")
    assert message.endswith(f"and the model cannot train on a partial {what}. Raise cutoff_len, {remedy}, "
                            "or remove the row."), message


def test_audio_rows_cutoff_len_would_cut_are_found_before_training(lf, tmp_path, monkeypatch):
    """The tiny Qwen2.5-Omni thinker on generated clips: rows whose audio tokens cutoff_len cuts
    are found before training, and each row's message says to shorten its audio."""
    pytest.importorskip("soundfile")
    from odb_factory.demo.audio_data import write_audio_demo
    from odb_factory.demo.tiny_omni import build_tiny_qwen25omni
    from odb_factory.llamafactory.lazy_dataset import TruncatedVisionTokensError
    model = build_tiny_qwen25omni(tmp_path / "tiny_omni", seed=0)
    data = write_audio_demo(tmp_path / "data", image_dir=None, seed=0)
    config = base_yaml(model, data, tmp_path / "out", template="qwen2_omni", dataset="omni_demo", odb_enable=True,
                       cutoff_len=256)
    with pytest.raises(TruncatedVisionTokensError) as caught:
        _datasets(lf, config)
    first = str(caught.value).splitlines()[1]   # "  training row N: cutoff_len=256 cuts into its audio tokens ..."
    assert ": cutoff_len=256 cuts into its audio tokens (kept " in first, first
    row = int(first.split(":")[0].split()[-1])
    _assert_the_row_names_its_remedy(lf, config, monkeypatch, row, "audio", "shorten its audio")
