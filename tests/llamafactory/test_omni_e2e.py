"""End-to-end: LLaMA-Factory training (lf_runs.train) on the tiny Qwen2.5-Omni thinker (template qwen2_omni)
with odb_* keys, on generated wav/flac/mp3 clips (16 and 44.1 kHz, mono and stereo) read by the
audio-reading patch, with the audio and vision towers trainable and every stage balanced (LLM,
vision, audio), on 2 CPU ranks."""

from __future__ import annotations

import json

import pytest
from tests.helpers.lf_runs import SHARED_DEMO, base_yaml, ledger, log_history, train, trained_indices

pytest.importorskip("llamafactory")
pytest.importorskip("soundfile")
pytestmark = pytest.mark.slow  # every test reads the module's 2-rank training run

ODB = {"odb_enable": True, "odb_step": "groups", "odb_loss_scaling": "exact", "odb_token_budget": 1024,
       "odb_buffer_size": 32, "odb_collate_workers": 1}
# A trainable audio tower leaves its audio_bos_eos_token out of every forward: DDP must look for
# unused parameters, which reentrant gradient checkpointing (LLaMA-Factory's default) does not allow.
TRAINABLE_TOWERS = {"freeze_vision_tower": False, "ddp_find_unused_parameters": True, "use_reentrant_gc": False}


@pytest.fixture(scope="module")
def omni_run(tmp_path_factory):
    from odb_factory.demo.audio_data import DATA_FILE, write_audio_demo
    from odb_factory.demo.tiny_omni import build_tiny_qwen25omni

    root = tmp_path_factory.mktemp("omni_ddp")
    model = build_tiny_qwen25omni(root / "tiny_omni", seed=0)
    image_dir = SHARED_DEMO / "mllm_demo_data"
    data = write_audio_demo(root / "data", image_dir=image_dir if image_dir.is_dir() else None, seed=0)
    num_rows = len(json.loads((data / DATA_FILE).read_text()))
    out, audit = root / "out", root / "audit"
    # every stage balanced: LLM (loader), vision and audio (in the thinker)
    config = base_yaml(model, data, out, template="qwen2_omni", dataset="omni_demo", odb_audit_dir=str(audit),
                       odb_balance=True, odb_balance_stages=["llm", "vision", "audio"], **ODB, **TRAINABLE_TOWERS)
    train(config, nproc=2, timeout=300)
    return model, out, ledger(audit), num_rows


def test_two_ranks_train_every_audio_sample_once(omni_run):
    _, out, rows, num_rows = omni_run
    steps = {rank: [r["step"] for r in rows if r["rank"] == rank] for rank in (0, 1)}
    assert steps[0] and steps[0] == steps[1], "both ranks ran the same optimizer steps"
    assert trained_indices(rows) == list(range(num_rows))
    history = [h for h in log_history(out) if "loss" in h]
    assert history and all(h["loss"] > 0 for h in history)
    assert json.loads((out / "train_results.json").read_text())["epoch"] == pytest.approx(1.0)


def test_the_audio_tower_was_trained(omni_run):
    from safetensors.torch import load_file

    model, out, _, _ = omni_run
    # the build holds the Omni model's thinker.* weights; LLaMA-Factory saves the thinker it trained
    before = {k.removeprefix("thinker."): v for k, v in load_file(str(model / "model.safetensors")).items()}
    after = load_file(str(out / "model.safetensors"))
    assert after.keys() == before.keys()
    assert not after["audio_tower.conv1.weight"].equal(before["audio_tower.conv1.weight"])
    assert not after["audio_tower.layers.0.fc1.weight"].equal(before["audio_tower.layers.0.fc1.weight"])
    # never in a forward, so no gradient: the parameter DDP has to be told about
    assert after["audio_tower.audio_bos_eos_token.weight"].equal(before["audio_tower.audio_bos_eos_token.weight"])


def test_every_stage_balanced_logs_the_encoder_stages(omni_run):
    _, out, rows, _ = omni_run
    assert sum(r["audio_frames"] for r in rows) > 0  # the loader counted the clips' frames
    assert any(h.get("odb/audio_frames_per_step", 0) > 0 for h in log_history(out))
    logged = [h for h in log_history(out) if "loss" in h]
    for stage in ("audio", "vision"):
        before = [h[f"odb/{stage}_max_over_lb_before"] for h in logged if f"odb/{stage}_max_over_lb_before" in h]
        after = [h[f"odb/{stage}_max_over_lb_after"] for h in logged if f"odb/{stage}_max_over_lb_after" in h]
        assert before and len(before) == len(after), stage
        assert all(a <= b + 1e-9 for a, b in zip(after, before)), (stage, before, after)
        assert all(a >= 1.0 - 1e-9 for a in after)
    # the audio stage did move clips at least once (ranks' clip frames differ in this data)
    assert any(h.get("odb/audio_moved_items", 0) > 0 for h in logged)


def test_a_trainable_audio_tower_without_unused_parameter_detection_is_refused(omni_run, monkeypatch):
    from odb_factory.llamafactory.arguments import check_model, ddp_unused_parameter_problems, parse_odb_arguments

    model, _, _, _ = omni_run
    raw = {"model_name_or_path": str(model), "finetuning_type": "full", "freeze_vision_tower": False}
    odb = parse_odb_arguments({"odb_enable": True})
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it in every worker
    with pytest.raises(ValueError, match=r"^freeze_vision_tower: false trains the audio tower of this qwen2_5_omni "
                                         r"model, .* set ddp_find_unused_parameters: true \(with use_reentrant_gc: false\)"):
        check_model(odb, raw)
    with pytest.raises(ValueError, match=r"^ddp_find_unused_parameters: true with reentrant gradient checkpointing"):
        check_model(odb, {**raw, "ddp_find_unused_parameters": True})
    check_model(odb, {**raw, **TRAINABLE_TOWERS})  # what the run above trains with
    # where nothing is refused: frozen towers (the default), one process, DeepSpeed, LoRA,
    # no checkpointing (transformers then looks for unused parameters itself), other models
    for fine in ({"freeze_vision_tower": True}, {"deepspeed": "ds.json"}, {"finetuning_type": "lora"},
                 {"disable_gradient_checkpointing": True}):
        assert ddp_unused_parameter_problems({**raw, **fine}, "qwen2_5_omni", 2) == []
    assert ddp_unused_parameter_problems(raw, "qwen2_5_omni", 1) == []
    assert ddp_unused_parameter_problems(raw, "qwen3_vl", 2) == []


def test_rows_whose_audio_tokens_cutoff_len_would_cut_are_named_before_training(omni_run, tmp_path):
    model, _, _, _ = omni_run
    config = base_yaml(model, model.parent / "data", tmp_path / "out", template="qwen2_omni", dataset="omni_demo",
                       cutoff_len=256, **ODB)
    proc = train(config, nproc=1, timeout=300, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "would lose image/video/audio tokens to cutoff_len=256 (found before training;" in text, text[-3000:]
    assert "cuts into its audio tokens" in text
