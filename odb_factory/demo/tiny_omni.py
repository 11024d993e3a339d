"""A tiny random Qwen2.5-Omni (thinker only), built offline and deterministically, for CPU runs of
LLaMA-Factory on audio data.

``build_tiny_qwen25omni(out_dir)`` writes a directory usable as ``model_name_or_path`` with LLaMA-Factory's
``qwen2_omni`` template, in the layout of the released Qwen2.5-Omni checkpoints: a ``qwen2_5_omni`` config
with ``enable_audio_output: false`` (no talker, no token2wav weights), ``thinker.*`` weights (random, ~3 MB)
and a ``spk_dict.pt`` (empty: no voices; transformers' ``from_pretrained`` of the Omni model requires the
file). LLaMA-Factory 0.9.5 loads it with ``AutoModelForTextToWaveform`` and keeps ``model.thinker``, a
``Qwen2_5OmniThinkerForConditionalGeneration`` of model type ``qwen2_5_omni_thinker``, the type its
collator (audio rope index) and ``freeze_vision_tower`` (vision and audio towers) look for. This layout
loads on transformers 5.x and 4.57 (4.57 has no auto class for a bare ``qwen2_5_omni_thinker`` config).
Not for ``train_from_scratch: true``: LLaMA-Factory then builds the Omni wrapper from the config and does
not take out the thinker.

* tokenizer: the byte-level BPE of the other tiny models (``tiny_model._train_tokenizer``) plus the Omni
  special tokens ``<|AUDIO|>``, ``<|audio_bos|>``, ``<|audio_eos|>``, ``<|vision_bos|>``,
  ``<|vision_eos|>``, ``<|IMAGE|>``, ``<|VIDEO|>``, also named on the tokenizer (``audio_token``,
  ``image_token``, ...) as ``Qwen2_5OmniProcessor`` expects;
* thinker: text hidden 64, 2 layers, 4 heads / 2 KV heads (head_dim 16), M-RoPE [2, 3, 3]; vision tower as
  the tiny Qwen2.5-VL's (depth 2, hidden 64, patch 14, merge 2, window 112 px), out_hidden_size 64; audio
  tower d_model 64, 2 layers, 4 heads, 128 mel bins, ``n_window`` 100 (attention in 2 s chunks, Qwen's
  ``seconds_per_chunk``), output_dim 64; token ids from the tokenizer;
* ``Qwen2_5OmniProcessor`` = ``WhisperFeatureExtractor`` (128 mel bins, 16 kHz, hop 160: 100 frames/s,
  padded to 30 s) + ``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor`` (multiples of 28 px) + tokenizer
  + a ChatML chat template with the Omni media markers.

A clip of ``f`` feature frames becomes ``((f - 1) // 2 + 1 - 2) // 2 + 1`` ``<|AUDIO|>`` tokens (about 25
per second), the count LLaMA-Factory's ``Qwen2OmniPlugin`` and the audio tower agree on.

Idempotent like the other tiny builders (``tiny_model.build_tiny``): a finished build writes
``odb_tiny_build.json`` last (with ``kind: qwen2_5_omni``); a later call with the same version and seed
returns at once.

CLI: ``python -m odb_factory.demo.tiny_omni OUT_DIR [--seed N] [--force]``.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from odb_factory.demo import tiny_qwen25vl
from odb_factory.demo.tiny_model import (
    CHAT_TEMPLATE,
    VOCAB_PAD_MULTIPLE,
    _token_ids,
    build_cli,
    build_tiny,
    make_image_processor,
    rope_for_installed_transformers,
)

KIND = "qwen2_5_omni"

# Named special tokens of the Omni tokenizer (Qwen2_5OmniProcessor reads tokenizer.<name>); their ids
# follow the shared tokenizer's added tokens.
OMNI_TOKENS: dict[str, str] = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
}

TEXT_CONFIG: dict[str, Any] = dict(tiny_qwen25vl.TEXT_CONFIG)  # hidden 64, 2 layers, M-RoPE [2, 3, 3]
VISION_CONFIG: dict[str, Any] = {
    key: tiny_qwen25vl.VISION_CONFIG[key]
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                "spatial_merge_size", "temporal_patch_size", "window_size", "fullatt_block_indexes",
                "out_hidden_size", "hidden_act", "initializer_range")
}
AUDIO_CONFIG: dict[str, Any] = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "d_model": 64,
    "activation_function": "gelu",
    "max_source_positions": 1500,  # 30 s of frames after the stride-2 convolution
    "n_window": 100,  # the tower attends within chunks of 2 * n_window frames (2 s)
    "output_dim": 64,  # = text hidden
    "initializer_range": 0.02,
}
SPEAKERS_FILE = "spk_dict.pt"
SAMPLING_RATE = 16000
MEL_HOP = 160  # 100 feature frames per second
MEL_N_FFT = 400
CHUNK_SECONDS = 30  # WhisperFeatureExtractor pads (and cuts) every clip to 30 s
IMAGE_MIN_PIXELS = tiny_qwen25vl.IMAGE_MIN_PIXELS
IMAGE_MAX_PIXELS = tiny_qwen25vl.IMAGE_MAX_PIXELS
VIDEO_MIN_PIXELS = tiny_qwen25vl.VIDEO_MIN_PIXELS
VIDEO_MAX_PIXELS = tiny_qwen25vl.VIDEO_MAX_PIXELS

# The shared ChatML template with the Omni markers (LLaMA-Factory's qwen2_omni template does the
# formatting during training; this one serves apply_chat_template users).
CHAT_TEMPLATE_OMNI = (
    CHAT_TEMPLATE
    .replace("'<|vision_start|><|image_pad|><|vision_end|>'", "'<|vision_bos|><|IMAGE|><|vision_eos|>'")
    .replace("'<|vision_start|><|video_pad|><|vision_end|>'", "'<|vision_bos|><|VIDEO|><|vision_eos|>'")
    .replace("{%- elif 'text' in item -%}",
             "{%- elif item['type'] == 'audio' or 'audio' in item -%}"
             "{{- '<|audio_bos|><|AUDIO|><|audio_eos|>' -}}"
             "{%- elif 'text' in item -%}")
)


def _add_omni_tokens(tok) -> None:
    """Add the Omni special tokens to the shared tokenizer, in place (idempotent), and name them
    (``tok.audio_token`` ...; saved into tokenizer_config.json)."""
    from tokenizers import AddedToken
    import transformers

    missing = [t for t in OMNI_TOKENS.values() if t not in tok.get_vocab()]
    if missing:
        extra = [AddedToken(t, special=True, normalized=False) for t in missing]
        key = "additional_special_tokens" if transformers.__version__.startswith("4.") else "extra_special_tokens"
        tok.add_special_tokens({key: extra}, **{f"replace_{key}": False})
    if getattr(tok, "audio_token", None) != OMNI_TOKENS["audio_token"]:
        # transformers has no public setter for named model-specific tokens on a built tokenizer
        tok._set_model_specific_special_tokens(special_tokens=dict(OMNI_TOKENS))
        if transformers.__version__.startswith("4."):
            tok.extra_special_tokens = {**(tok.extra_special_tokens or {}), **OMNI_TOKENS}
    tok.chat_template = CHAT_TEMPLATE_OMNI


def _make_config(tok):
    from transformers import Qwen2_5OmniConfig

    _add_omni_tokens(tok)
    ids = _token_ids(tok)
    omni = {t: tok.convert_tokens_to_ids(t) for t in OMNI_TOKENS.values()}
    if len(set(omni.values()) | set(ids.values())) != len(omni) + len(ids):
        raise RuntimeError(f"tiny tokenizer: Omni tokens not mapped to distinct new ids: {omni}")
    ids.update(omni)
    vocab_size = -(-len(tok) // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    text = dict(rope_for_installed_transformers(copy.deepcopy(TEXT_CONFIG)), vocab_size=vocab_size,
                pad_token_id=ids["<|endoftext|>"], bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                tie_word_embeddings=False)
    user = tok.convert_tokens_to_ids("user")  # Qwen's user_token_id is the id of "user"
    thinker = dict(
        text_config=text,
        vision_config=dict(VISION_CONFIG, out_hidden_size=TEXT_CONFIG["hidden_size"]),
        audio_config=dict(AUDIO_CONFIG, output_dim=TEXT_CONFIG["hidden_size"]),
        audio_token_index=ids["<|AUDIO|>"],
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        user_token_id=user if isinstance(user, int) and user != tok.unk_token_id else ids["<|im_start|>"],
        position_id_per_seconds=25,
        seconds_per_chunk=2,
        tie_word_embeddings=False,
        # read by the thinker's get_rope_index; not declared fields of the thinker config (as in Qwen's)
        vision_start_token_id=ids["<|vision_bos|>"],
        vision_end_token_id=ids["<|vision_eos|>"],
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        dtype="float32",
    )
    config = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    config.dtype = "float32"
    # top-level copies: HF Trainer's align_special_tokens compares the tokenizer with these
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    return config, ids


def _make_processor(tok):
    import transformers
    from transformers import Qwen2_5OmniProcessor, Qwen2VLVideoProcessor, WhisperFeatureExtractor

    _add_omni_tokens(tok)
    feature_extractor = WhisperFeatureExtractor(
        feature_size=AUDIO_CONFIG["num_mel_bins"], sampling_rate=SAMPLING_RATE, hop_length=MEL_HOP,
        chunk_length=CHUNK_SECONDS, n_fft=MEL_N_FFT, padding_value=0.0, return_attention_mask=True,
    )
    image_processor = make_image_processor(VISION_CONFIG, IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS)
    if transformers.__version__.startswith("4."):
        # 4.x saves the image processor and then the feature extractor to the same
        # preprocessor_config.json; as in Qwen's released file, that one file holds both
        for key, value in image_processor.to_dict().items():
            if not hasattr(feature_extractor, key):
                setattr(feature_extractor, key, value)
    video_processor = Qwen2VLVideoProcessor(
        patch_size=VISION_CONFIG["patch_size"],
        temporal_patch_size=VISION_CONFIG["temporal_patch_size"],
        merge_size=VISION_CONFIG["spatial_merge_size"],
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
    )
    processor = Qwen2_5OmniProcessor(
        image_processor=image_processor, video_processor=video_processor, feature_extractor=feature_extractor,
        tokenizer=tok, chat_template=CHAT_TEMPLATE_OMNI,
    )
    # the build saves the processor into its temporary directory: the speaker file goes along
    processor.save_pretrained = functools.partial(_save_with_speakers, processor.save_pretrained)
    return processor


def _save_with_speakers(save_pretrained, save_directory, *args, **kwargs):
    """The processor's save_pretrained, then an empty ``spk_dict.pt`` beside it (no voices: the tiny
    model has no talker; Qwen2_5OmniForConditionalGeneration.from_pretrained loads the file)."""
    import torch

    out = save_pretrained(save_directory, *args, **kwargs)
    torch.save({}, Path(save_directory) / SPEAKERS_FILE)
    return out


def build_tiny_qwen25omni(out_dir: str | Path, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the tiny Qwen2.5-Omni in ``out_dir`` and return its path (offline,
    deterministic, idempotent: see `tiny_model.build_tiny`)."""
    return build_tiny(out_dir, seed, force, KIND, "Qwen2_5OmniForConditionalGeneration",
                      _make_config, _make_processor)


def main(argv: list[str] | None = None) -> None:
    build_cli(build_tiny_qwen25omni, "Qwen2.5-Omni thinker", argv)


if __name__ == "__main__":
    main()
