"""A tiny random Qwen2.5-VL, built offline and deterministically, for CPU runs of LLaMA-Factory.

``build_tiny_qwen25vl(out_dir)`` writes a directory usable as ``model_name_or_path`` with LLaMA-Factory's
``qwen2_vl`` template (random weights are saved too, a few MB):

* tokenizer: the same byte-level BPE as the tiny Qwen3-VL (``tiny_model._train_tokenizer``), with the Qwen
  special tokens (``<|vision_start|>``, ``<|image_pad|>``, ...) and a ChatML chat template;
* ``Qwen2_5_VLConfig``: text hidden 64, 2 layers, 4 heads / 2 KV heads (head_dim 16), M-RoPE [2, 3, 3];
  vision depth 2, hidden 64, patch 14, merge 2, window 112 px (= 4 x 4 merged tokens), full attention in
  vision block 1 (windowed in block 0), out_hidden_size 64 = text hidden; token ids from the tokenizer;
* ``Qwen2_5_VLProcessor`` = ``Qwen2VLImageProcessor`` (patch 14, merge 2, so sizes are multiples of 28 px)
  + ``Qwen2VLVideoProcessor`` + tokenizer + the ChatML chat template.

Idempotent like ``tiny_model.build_tiny_qwen3vl``: a finished build writes ``odb_tiny_build.json`` last
(with ``kind: qwen2_5_vl``); a later call with the same version and seed returns at once. Builds go to a
temporary sibling directory first, so concurrent callers never see a half-written model.

CLI: ``python -m odb_factory.demo.tiny_qwen25vl OUT_DIR [--seed N] [--force]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from odb_factory.demo.tiny_model import CHAT_TEMPLATE, build_cli, build_tiny, make_image_processor, make_vl_config

KIND = "qwen2_5_vl"

TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # head_dim = 64 / 4 = 16 (Qwen2.5-VL derives it)
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "use_sliding_window": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [2, 3, 3],  # (t, h, w), sums to head_dim / 2
    },
}
VISION_CONFIG: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "in_channels": 3,
    "patch_size": 14,  # as Qwen2.5-VL: one merged token per 28 x 28 px
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "tokens_per_second": 2,
    # windows of 112 px = 4 x 4 merged tokens (8 x 8 patches); images up to 256 px span several windows
    "window_size": 112,
    "fullatt_block_indexes": [1],  # < depth: block 0 windowed, block 1 full attention
    "out_hidden_size": 64,  # = text hidden
    "hidden_act": "silu",
    "initializer_range": 0.02,
}
MERGED_PX = VISION_CONFIG["patch_size"] * VISION_CONFIG["spatial_merge_size"]  # 28
IMAGE_MIN_PIXELS = MERGED_PX * MERGED_PX  # one merged token
IMAGE_MAX_PIXELS = 512 * 512
VIDEO_MIN_PIXELS = MERGED_PX * MERGED_PX * 4
VIDEO_MAX_PIXELS = 128 * 128 * 4


def _make_config(tok):
    from transformers import Qwen2_5_VLConfig

    config, ids = make_vl_config(Qwen2_5_VLConfig, tok, TEXT_CONFIG, VISION_CONFIG)
    config.bos_token_id = None
    return config, ids


def _make_processor(tok):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

    video_processor = Qwen2VLVideoProcessor(
        patch_size=VISION_CONFIG["patch_size"],
        temporal_patch_size=VISION_CONFIG["temporal_patch_size"],
        merge_size=VISION_CONFIG["spatial_merge_size"],
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
    )
    return Qwen2_5_VLProcessor(
        image_processor=make_image_processor(VISION_CONFIG, IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS), tokenizer=tok,
        video_processor=video_processor, chat_template=CHAT_TEMPLATE
    )


def build_tiny_qwen25vl(out_dir: str | Path, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the tiny Qwen2.5-VL in ``out_dir`` and return its path (offline,
    deterministic, idempotent: see `tiny_model.build_tiny`)."""
    return build_tiny(out_dir, seed, force, KIND, "Qwen2_5_VLForConditionalGeneration",
                      _make_config, _make_processor)


def main(argv: list[str] | None = None) -> None:
    build_cli(build_tiny_qwen25vl, "Qwen2.5-VL", argv)


if __name__ == "__main__":
    main()
