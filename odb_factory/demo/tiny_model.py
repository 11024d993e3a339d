"""A tiny random Qwen3-VL, built offline and deterministically, for CPU runs of LLaMA-Factory.

``build_tiny_qwen3vl(out_dir)`` writes a directory usable as ``model_name_or_path`` (with or without
``train_from_scratch: true``; random weights are saved too, ~3 MB):

* tokenizer: byte-level BPE (~2k tokens) trained with ``tokenizers`` on generated text, with the Qwen
  pre-tokenizer and special tokens, saved as ``Qwen2Tokenizer`` (``<|im_end|>`` eos, ``<|endoftext|>`` pad);
* ``Qwen3VLConfig``: text hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16, M-RoPE [4, 2, 2];
  vision depth 2, hidden 64, patch 16, merge 2, deepstack at vision layer 1; token ids from the tokenizer;
* ``Qwen3VLProcessor`` = ``Qwen2VLImageProcessor`` + ``Qwen3VLVideoProcessor`` + tokenizer + a ChatML
  chat template.

Idempotent: a finished build writes ``odb_tiny_build.json`` last (version, seed, file hashes); a later call
with the same version and seed returns at once. Builds go to a temporary sibling directory first, so
concurrent callers (e.g. several ranks) never see a half-written model.

CLI: ``python -m odb_factory.demo.tiny_model OUT_DIR [--seed N] [--force]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

BUILD_VERSION = 1
MARKER = "odb_tiny_build.json"

BPE_VOCAB_SIZE = 2000  # incl. the 256 byte symbols; special tokens come after, as in Qwen
VOCAB_PAD_MULTIPLE = 64  # embedding rows are rounded up (Qwen's vocab_size > len(tokenizer) too)

# Same pre-tokenization as transformers' Qwen2Tokenizer, so the trained merges fit the loaded tokenizer.
QWEN_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Special tokens in Qwen's order (ids follow the BPE vocab).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Added but not special (Qwen3 keeps these visible in decoded text).
PLAIN_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

# ChatML with Qwen-VL style media markers; LLaMA-Factory's own template (qwen3_vl_nothink) does the
# formatting during training, this one serves apply_chat_template users.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or 'image' in item -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in item -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_bias": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": [4, 2, 2],  # sums to head_dim / 2
        "mrope_interleaved": True,
    },
}
VISION_CONFIG: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 64,  # = text hidden
    "num_position_embeddings": 256,  # 16 x 16 grid, a perfect square
    "deepstack_visual_indexes": [1],  # < depth; one deepstack feature, added at text layer 0
    "hidden_act": "gelu_pytorch_tanh",
    "initializer_range": 0.02,
}
# Image sizes in pixels: 32 x 32 (one merged token) .. 512 x 512; LF's image_max_pixels caps further.
IMAGE_MIN_PIXELS = 32 * 32
IMAGE_MAX_PIXELS = 512 * 512
VIDEO_MIN_PIXELS = 32 * 32 * 4
VIDEO_MAX_PIXELS = 128 * 128 * 4


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    try:
        with open(out_dir / MARKER, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_complete_build(out_dir: str | Path, seed: int | None = None, kind: str = "qwen3_vl") -> bool:
    """True if ``out_dir`` holds a finished build of this version (and ``seed``, if given)."""
    out = Path(out_dir)
    marker = _read_marker(out)
    if not marker or marker.get("build_version") != BUILD_VERSION or marker.get("kind") != kind:
        return False
    if seed is not None and marker.get("seed") != seed:
        return False
    files = marker.get("files") or {}
    return bool(files) and all(
        (out / name).is_file() and (out / name).stat().st_size == size for name, (size, _) in files.items()
    )


def _corpus(seed: int) -> list[str]:
    from odb_factory.demo.synthetic_data import corpus_lines

    lines = corpus_lines(seed)
    # role names and template glue, so that they get merges of their own
    lines += ["system\nuser\nassistant\n"] * 50 + ["Picture 1: Video 2: <image> <video>\n"] * 10
    return lines


def _train_tokenizer(seed: int):
    """Train the byte-level BPE (deterministic) and wrap it as transformers' Qwen2Tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    import transformers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    bpe.train_from_iterator(_corpus(seed), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    # Fix the ids of the added tokens in Qwen's order right after the BPE vocab; the tokenizer then
    # registers them as added tokens under these ids (independent of the order __init__ adds eos/pad).
    base = len(vocab)
    for i, t in enumerate(SPECIAL_TOKENS + PLAIN_ADDED_TOKENS):
        vocab[t] = base + i

    options = dict(unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                   errors="replace", model_max_length=8192, split_special_tokens=False)
    extra = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[1:]]
    if transformers.__version__.startswith("4."):
        # 4.x builds the (fast) tokenizer from files and calls the extra special tokens "additional"
        from transformers import Qwen2TokenizerFast
        with tempfile.TemporaryDirectory() as folder:
            vocab_file, merges_file = Path(folder) / "vocab.json", Path(folder) / "merges.txt"
            vocab_file.write_text(json.dumps(vocab))
            merges_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
            tok = Qwen2TokenizerFast(vocab_file=str(vocab_file), merges_file=str(merges_file), **options)
        tok.add_special_tokens({"additional_special_tokens": extra}, replace_additional_special_tokens=True)
    else:
        tok = Qwen2Tokenizer(vocab=vocab, merges=merges, **options)
        tok.add_special_tokens({"extra_special_tokens": extra}, replace_extra_special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS + PLAIN_ADDED_TOKENS):
        if tok.convert_tokens_to_ids(t) != base + i:
            raise RuntimeError(f"tiny tokenizer: {t} got id {tok.convert_tokens_to_ids(t)}, expected {base + i}")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _token_ids(tok) -> dict[str, int]:
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS}
    unk = [t for t, i in ids.items() if i is None or (tok.unk_token_id is not None and i == tok.unk_token_id)]
    if unk or len(set(ids.values())) != len(ids):
        raise RuntimeError(f"tiny tokenizer: special tokens not mapped to distinct ids: {ids}")
    return ids


def rope_for_installed_transformers(text_config: dict) -> dict:
    """transformers 5.x reads `rope_parameters`; 4.x reads `rope_theta` and `rope_scaling`
    (where Qwen-VL keeps its mrope sections)."""
    import transformers

    if not transformers.__version__.startswith("4.") or "rope_parameters" not in text_config:
        return text_config
    text = {k: v for k, v in text_config.items() if k != "rope_parameters"}
    rope = dict(text_config["rope_parameters"])
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    return text


def make_vl_config(config_class, tok, text_config: dict, vision_config: dict):
    """A Qwen-VL config whose special-token ids are the tiny tokenizer's (shared by the
    Qwen3-VL and Qwen2.5-VL builders). Returns (config, token ids)."""
    import copy

    ids = _token_ids(tok)
    vocab_size = -(-len(tok) // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    text = dict(rope_for_installed_transformers(copy.deepcopy(text_config)), vocab_size=vocab_size,
                pad_token_id=ids["<|endoftext|>"])
    text["bos_token_id"] = None  # like the tokenizer (Qwen has no BOS); avoids HF's token-alignment warning
    text["eos_token_id"] = ids["<|im_end|>"]
    config = config_class(
        text_config=text,
        vision_config=dict(vision_config, out_hidden_size=text_config["hidden_size"]),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.dtype = "float32"
    # top-level copies: HF Trainer's align_special_tokens compares the tokenizer with these
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    return config, ids


def _make_config(tok):
    from transformers import Qwen3VLConfig

    return make_vl_config(Qwen3VLConfig, tok, TEXT_CONFIG, VISION_CONFIG)


def make_image_processor(vision_config: dict, min_pixels: int, max_pixels: int):
    """The image processor both tiny builders use (grid sizes follow the vision config)."""
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(
        patch_size=vision_config["patch_size"],
        temporal_patch_size=vision_config["temporal_patch_size"],
        merge_size=vision_config["spatial_merge_size"],
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def _make_processor(tok):
    from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor

    image_processor = make_image_processor(VISION_CONFIG, IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS)
    video_processor = Qwen3VLVideoProcessor(
        patch_size=VISION_CONFIG["patch_size"],
        temporal_patch_size=VISION_CONFIG["temporal_patch_size"],
        merge_size=VISION_CONFIG["spatial_merge_size"],
        size={"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS},
        fps=2,
        min_frames=2,
        max_frames=16,
    )
    return Qwen3VLProcessor(
        image_processor=image_processor, tokenizer=tok, video_processor=video_processor, chat_template=CHAT_TEMPLATE
    )


def write_build(tmp: Path, seed: int, kind: str, model_class: str, make_config, make_processor) -> None:
    """Write a tiny model of `kind` (config/processor factories over the shared tokenizer)
    into ``tmp``, marker last."""
    import torch
    import transformers
    from transformers import GenerationConfig

    tok = _train_tokenizer(seed)
    config, ids = make_config(tok)
    processor = make_processor(tok)
    processor.save_pretrained(tmp)  # tokenizer files + processor_config / preprocessor / video configs

    torch_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(config)
    finally:
        torch.random.set_rng_state(torch_state)
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    ).save_pretrained(tmp)

    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            files[p.relative_to(tmp).as_posix()] = [p.stat().st_size, _sha256(p)]
    marker = {
        "build_version": BUILD_VERSION,
        "kind": kind,
        "seed": seed,
        "token_ids": ids,
        "vocab_size": config.get_text_config().vocab_size,
        "len_tokenizer": len(tok),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "files": files,
    }
    with open(tmp / MARKER, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=2, sort_keys=True)
        f.write("\n")


def _install(tmp: Path, out: Path, seed: int, kind: str) -> None:
    """Move a finished build from ``tmp`` into ``out`` (marker last), tolerating a concurrent winner."""
    try:
        os.rename(tmp, out)  # atomic when ``out`` is absent or an empty directory
        return
    except OSError:
        pass
    if is_complete_build(out, seed=seed, kind=kind):
        return  # another process finished first (its build is identical for the same seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    for p in sorted(tmp.rglob("*")):
        if p.is_file() and p.name != MARKER:
            dst = out / p.relative_to(tmp)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, dst)
    os.replace(tmp / MARKER, out / MARKER)


def _make_readable(root: Path) -> None:
    os.chmod(root, 0o755)  # mkdtemp makes 0700; the model dir is shared by every rank / user
    for p in root.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def build_tiny(out_dir: str | Path, seed: int, force: bool, kind: str, model_class: str,
               make_config, make_processor) -> Path:
    """Build (or reuse) a tiny model of `kind` in ``out_dir`` and return its path.

    Offline and deterministic: the same ``seed`` gives byte-identical files. Returns immediately when
    ``out_dir`` already holds a complete build of this ``BUILD_VERSION``, kind and seed (unless ``force``).
    """
    out = Path(out_dir).absolute()
    if not force and is_complete_build(out, seed=seed, kind=kind):
        return out
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        write_build(tmp, seed, kind, model_class, make_config, make_processor)
        _make_readable(tmp)
        if force and out.exists():
            (out / MARKER).unlink(missing_ok=True)
        _install(tmp, out, seed, kind)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not is_complete_build(out, seed=seed, kind=kind):
        raise RuntimeError(f"tiny {kind} build in {out} is incomplete")
    return out


def build_tiny_qwen3vl(out_dir: str | Path, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the tiny Qwen3-VL in ``out_dir`` (see `build_tiny`)."""
    return build_tiny(out_dir, seed, force, "qwen3_vl", "Qwen3VLForConditionalGeneration",
                      _make_config, _make_processor)


def build_cli(build, name: str, argv: list[str] | None = None) -> None:
    """`python -m ...` entry of a tiny-model builder."""
    p = argparse.ArgumentParser(description=f"Build the tiny random {name} (offline, deterministic).")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    a = p.parse_args(argv)
    print(build(a.out_dir, seed=a.seed, force=a.force))


def main(argv: list[str] | None = None) -> None:
    build_cli(build_tiny_qwen3vl, "Qwen3-VL", argv)


if __name__ == "__main__":
    main()
