"""A tiny random text-only Qwen3, built offline and deterministically, for CPU runs of LLaMA-Factory.

``build_tiny_qwen3(out_dir)`` writes a directory usable as ``model_name_or_path`` with
LLaMA-Factory's ``qwen3_nothink`` template: the tiny Qwen3-VL's tokenizer and chat template,
and a ``Qwen3Config`` with the same text tower (hidden 64, 2 layers, 4 heads / 2 KV heads,
head_dim 16). A text-only model is the case where LLaMA-Factory's trainer lets transformers
normalise the loss by the step's global token count (not per micro-batch), so it tests the
other half of ODB's `odb_loss_scaling: standard`.

Idempotent like ``tiny_model.build_tiny_qwen3vl`` (``kind: qwen3``).

CLI: ``python -m odb_factory.demo.tiny_qwen3 OUT_DIR [--seed N] [--force]``.
"""

from __future__ import annotations

from pathlib import Path

from odb_factory.demo.tiny_model import TEXT_CONFIG, VOCAB_PAD_MULTIPLE, _token_ids, build_cli, build_tiny

KIND = "qwen3"


def _make_config(tok):
    from transformers import Qwen3Config

    ids = _token_ids(tok)
    text = {k: v for k, v in TEXT_CONFIG.items() if k != "rope_parameters"}
    config = Qwen3Config(**text, vocab_size=-(-len(tok) // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE,
                         bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                         tie_word_embeddings=False)
    config.dtype = "float32"
    return config, ids


def _make_processor(tok):
    return tok  # text only: the tokenizer is the whole processor


def build_tiny_qwen3(out_dir: str | Path, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the tiny text-only Qwen3 in ``out_dir`` (see `tiny_model.build_tiny`)."""
    return build_tiny(out_dir, seed, force, KIND, "Qwen3ForCausalLM", _make_config, _make_processor)


def main(argv: list[str] | None = None) -> None:
    build_cli(build_tiny_qwen3, "Qwen3", argv)


if __name__ == "__main__":
    main()
