"""The tiny Qwen2.5-Omni thinker and the generated audio data: the build loads with transformers and
LLaMA-Factory's tokenizer loader, a real audio sample goes through the qwen2_omni template and
LLaMA-Factory's collator into a forward and backward pass, and both builders are deterministic."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import pytest

for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_k, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch = pytest.importorskip("torch")
pytest.importorskip("llamafactory")
pytest.importorskip("soundfile")

from odb_factory.demo.audio_data import CLIPS_FILE, DATA_FILE, DATASET_NAME, write_audio_demo
from odb_factory.demo.tiny_model import MARKER, is_complete_build
from odb_factory.balance.audio_plan import audio_output_tokens as audio_tokens
from odb_factory.demo.tiny_omni import KIND, OMNI_TOKENS, SPEAKERS_FILE, build_tiny_qwen25omni

SHARED_IMAGES = Path(__file__).resolve().parents[3] / "shared" / "data" / "llamafactory_demo" / "mllm_demo_data"


def _tree_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen25omni(tmp_path_factory.mktemp("tiny") / "omni", seed=0)


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory) -> Path:
    image_dir = SHARED_IMAGES if SHARED_IMAGES.is_dir() else None
    return write_audio_demo(tmp_path_factory.mktemp("data") / "omni", image_dir=image_dir, seed=0)


@pytest.fixture(scope="module")
def lf_parts(omni_dir):
    """LLaMA-Factory's tokenizer/processor (its loader sets the processor's limits), its qwen2_omni
    template, and the audio-reading patch every patched run has."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments, ModelArguments
    from llamafactory.model import load_tokenizer
    from odb_factory_patches import llamafactory_audio_reading

    llamafactory_audio_reading.apply()
    module = load_tokenizer(ModelArguments(model_name_or_path=str(omni_dir)))
    template = get_template_and_fix_tokenizer(module["tokenizer"], DataArguments(template="qwen2_omni"))
    return module["tokenizer"], module["processor"], template


def test_build_loads_with_the_omni_classes_and_matching_ids(omni_dir):
    from transformers import AutoConfig, AutoProcessor, Qwen2_5OmniProcessor, WhisperFeatureExtractor

    marker = json.loads((omni_dir / MARKER).read_text())
    assert is_complete_build(omni_dir, seed=0, kind=KIND)
    top = AutoConfig.from_pretrained(omni_dir)
    assert top.model_type == "qwen2_5_omni" and top.enable_audio_output is False
    config = top.thinker_config
    assert config.model_type == "qwen2_5_omni_thinker"
    assert SPEAKERS_FILE in marker["files"] and torch.load(omni_dir / SPEAKERS_FILE, weights_only=True) == {}
    ids = marker["token_ids"]
    assert (config.audio_token_id, config.image_token_id, config.video_token_id) == (
        ids["<|AUDIO|>"], ids["<|IMAGE|>"], ids["<|VIDEO|>"])
    assert (config.audio_start_token_id, config.audio_end_token_id) == (ids["<|audio_bos|>"], ids["<|audio_eos|>"])
    assert (config.vision_start_token_id, config.vision_end_token_id) == (ids["<|vision_bos|>"], ids["<|vision_eos|>"])
    hidden = config.text_config.hidden_size
    assert config.audio_config.output_dim == config.vision_config.out_hidden_size == hidden == 64
    assert config.text_config.vocab_size >= marker["len_tokenizer"]
    processor = AutoProcessor.from_pretrained(omni_dir)
    assert isinstance(processor, Qwen2_5OmniProcessor)
    fe = processor.feature_extractor
    assert isinstance(fe, WhisperFeatureExtractor)
    assert (fe.feature_size, fe.sampling_rate, fe.hop_length, fe.nb_max_frames) == (128, 16000, 160, 3000)
    assert fe.feature_size == config.audio_config.num_mel_bins
    tok = processor.tokenizer
    for name, token in OMNI_TOKENS.items():
        assert getattr(tok, name) == token and tok.convert_tokens_to_ids(token) == ids[token]
        assert tok.encode(f"a{token}b", add_special_tokens=False).count(ids[token]) == 1
    assert marker["num_parameters"] < 1_000_000
    turn = {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}
    text = processor.apply_chat_template([turn], add_generation_prompt=True)
    assert text == "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>hi<|im_end|>\n<|im_start|>assistant\n"


def test_build_is_idempotent_and_deterministic(omni_dir, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in omni_dir.iterdir()}
    t0 = time.perf_counter()
    assert build_tiny_qwen25omni(omni_dir, seed=0) == omni_dir
    assert time.perf_counter() - t0 < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in omni_dir.iterdir()} == before
    assert not is_complete_build(omni_dir, seed=1, kind=KIND)
    again = build_tiny_qwen25omni(tmp_path / "again", seed=0)
    assert _tree_hashes(again) == _tree_hashes(omni_dir)


def test_audio_demo_set(audio_dir, tmp_path):
    import soundfile as sf

    info = json.loads((audio_dir / "dataset_info.json").read_text())[DATASET_NAME]
    rows = json.loads((audio_dir / DATA_FILE).read_text())
    clips = json.loads((audio_dir / CLIPS_FILE).read_text())
    assert info["formatting"] == "sharegpt" and info["columns"]["audios"] == "audios"
    assert 24 <= len(rows) <= 48
    combos = {(c["format"], c["sampling_rate"], c["channels"]) for c in clips}
    assert combos == {(f, r, ch) for f in ("wav", "flac", "mp3") for r in (16000, 44100) for ch in (1, 2)}
    seconds = [c["seconds"] for c in clips]
    assert min(seconds) < 1.0 and max(seconds) > 10.0 and max(seconds) <= 12.0
    for c in clips:  # what was written reads back (frames and rate)
        meta = sf.info(str(audio_dir / c["file"]))
        assert (meta.frames, meta.samplerate, meta.channels) == (c["frames"], c["sampling_rate"], c["channels"])
    for row in rows:
        user = row["messages"][0]["content"]
        assert user.count("<audio>") == len(row["audios"]) and user.count("<image>") == len(row.get("images", []))
        assert all((audio_dir / a).is_file() for a in row["audios"])
    kinds = {("audio" if r["audios"] else "") + ("image" if r.get("images") else "") for r in rows}
    assert kinds == ({"audio", "audioimage", ""} if SHARED_IMAGES.is_dir() else {"audio", ""})
    one_word = [r for r in rows if r["audios"] and " " not in r["messages"][1]["content"]]
    long_asr = [r for r in rows if r["audios"] and len(r["messages"][1]["content"].split()) >= 10]
    assert one_word and long_asr
    # deterministic per seed, and another seed gives other data
    again = write_audio_demo(tmp_path / "again", image_dir=SHARED_IMAGES if SHARED_IMAGES.is_dir() else None, seed=0)
    assert _tree_hashes(again) == _tree_hashes(audio_dir)
    other = write_audio_demo(tmp_path / "other", seed=1)
    assert json.loads((other / DATA_FILE).read_text()) != rows


def _thinker(model_dir):
    """As LLaMA-Factory 0.9.5 loads a qwen2_5_omni checkpoint: the Omni model, then its thinker."""
    from transformers import AutoModelForTextToWaveform

    return AutoModelForTextToWaveform.from_pretrained(model_dir).thinker


def _feature(row, data_dir, tokenizer, processor, template):
    """One SFT sample as LLaMA-Factory's supervised processor makes it (media still paths)."""
    audios = [str(data_dir / a) for a in row["audios"]]
    images = row.get("images", [])
    messages = template.mm_plugin.process_messages(row["messages"], images, [], audios, processor)
    prompt, response = template.encode_oneturn(tokenizer, messages)
    return {"input_ids": prompt + response, "attention_mask": [1] * (len(prompt) + len(response)),
            "labels": [-100] * len(prompt) + response, "images": images, "videos": [], "audios": audios}


def test_real_audio_sample_trains_through_llamafactorys_collator(omni_dir, audio_dir, lf_parts):
    from llamafactory.data.collator import MultiModalDataCollatorForSeq2Seq

    tokenizer, processor, template = lf_parts
    model = _thinker(omni_dir)
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert model.config.model_type == "qwen2_5_omni_thinker"
    rows = json.loads((audio_dir / DATA_FILE).read_text())
    clips = {c["file"]: c for c in json.loads((audio_dir / CLIPS_FILE).read_text())}
    row = next(r for r in rows if len(r["audios"]) == 2)
    long_row = max((r for r in rows if len(r["audios"]) == 1), key=lambda r: clips[r["audios"][0]]["seconds"])
    collator = MultiModalDataCollatorForSeq2Seq(template=template, processor=processor, tokenizer=tokenizer,
                                                model=model, pad_to_multiple_of=8, label_pad_token_id=-100)
    features = [_feature(r, audio_dir, tokenizer, processor, template) for r in (row, long_row)]
    batch = collator(features)

    # the audio keys: log-mel features padded to 30 s, the valid-frame mask, one row per clip
    files = row["audios"] + long_row["audios"]
    assert batch["input_features"].shape == (3, 128, 3000)
    assert batch["feature_attention_mask"].shape == (3, 3000)
    frames = batch["feature_attention_mask"].sum(-1).tolist()
    for f, clip in zip(frames, files):  # one frame per 160 samples of the clip resampled to 16 kHz
        samples = math.ceil(clips[clip]["frames"] * 16000 / clips[clip]["sampling_rate"])
        assert f == math.ceil(samples / 160)
    audio_id = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert (batch["input_ids"] == audio_id).sum().item() == sum(audio_tokens(f) for f in frames)
    assert batch["position_ids"].shape[:2] == (4, 2)  # text row + 3 M-RoPE rows

    model.train()
    out = model(**batch)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    tower = model.audio_tower
    for name in ("conv1.weight", "layers.0.self_attn.q_proj.weight", "proj.weight"):
        grad = tower.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    # the audio tower's begin/end embedding takes no part in the forward: the reason a DDP run
    # with a trainable audio tower needs ddp_find_unused_parameters
    assert tower.audio_bos_eos_token.weight.grad is None


def test_text_only_batch_gets_the_fake_image_and_clip(omni_dir, audio_dir, lf_parts):
    from llamafactory.data.collator import MultiModalDataCollatorForSeq2Seq

    tokenizer, processor, template = lf_parts
    model = _thinker(omni_dir)
    rows = [r for r in json.loads((audio_dir / DATA_FILE).read_text()) if not r["audios"]][:2]
    collator = MultiModalDataCollatorForSeq2Seq(template=template, processor=processor, tokenizer=tokenizer,
                                                model=model, pad_to_multiple_of=8, label_pad_token_id=-100)
    batch = collator([_feature(r, audio_dir, tokenizer, processor, template) for r in rows])
    # 0.1 s of silence (1600 samples): 10 valid frames, 2 <|AUDIO|> tokens, attention 0, labels -100
    assert batch["input_features"].shape == (1, 128, 3000)
    assert batch["feature_attention_mask"].sum().item() == 10
    assert batch["image_grid_thw"].shape == (1, 3)
    audio_id = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    fake = batch["input_ids"] == audio_id
    assert fake.sum().item() == audio_tokens(10) == 2
    assert (batch["attention_mask"][fake] == 0).all() and (batch["labels"][fake] == -100).all()
    loss = model(**batch).loss
    assert torch.isfinite(loss)
