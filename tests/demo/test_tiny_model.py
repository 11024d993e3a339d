"""The embedded tiny Qwen3-VL and the generated demo data: load, train one step, determinism."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import pytest

for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_k, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from odb_factory.demo.synthetic_data import write_demo_dataset
from odb_factory.demo.tiny_model import MARKER, SPECIAL_TOKENS, build_tiny_qwen3vl, is_complete_build


def _tree_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3vl(tmp_path_factory.mktemp("tiny") / "qwen3vl", seed=0)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "data"
    write_demo_dataset(out, num_samples=200, seed=0, image_fraction=0.5)
    return out


def test_build_is_complete_and_idempotent(tiny_dir: Path):
    assert is_complete_build(tiny_dir, seed=0)
    marker = json.loads((tiny_dir / MARKER).read_text())
    assert {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "model.safetensors",
    } <= set(marker["files"])
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    t0 = time.perf_counter()
    assert build_tiny_qwen3vl(tiny_dir, seed=0) == tiny_dir
    assert time.perf_counter() - t0 < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before
    assert not is_complete_build(tiny_dir, seed=1)  # another seed would rebuild


def test_build_is_deterministic(tiny_dir: Path, tmp_path: Path):
    other = build_tiny_qwen3vl(tmp_path / "again", seed=0)
    assert _tree_hashes(other) == _tree_hashes(tiny_dir)
    assert not list(tmp_path.glob(".again.build-*"))  # temporary build dir cleaned up


def test_config_matches_tokenizer(tiny_dir: Path):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert cfg.model_type == "qwen3_vl"
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert cfg.text_config.eos_token_id == tok.eos_token_id
    assert cfg.text_config.pad_token_id == tok.pad_token_id
    assert len(tok) <= cfg.text_config.vocab_size
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + ("<think>", "</think>")]
    assert len(set(ids)) == len(ids) and None not in ids
    # special tokens are atomic; generated text round-trips through the byte-level BPE
    text = "<|im_start|>user\nKoun pe tremtel, 123 <think>x</think><|im_end|>"
    enc = tok(text, add_special_tokens=False)["input_ids"]
    assert enc[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(enc) == text
    assert 1500 <= len(tok) <= 4096
    vc, tc = cfg.vision_config, cfg.text_config
    assert vc.out_hidden_size == tc.hidden_size == 64
    assert int(vc.num_position_embeddings**0.5) ** 2 == vc.num_position_embeddings
    assert all(i < vc.depth for i in vc.deepstack_visual_indexes)
    assert sum(tc.rope_parameters["mrope_section"]) == tc.head_dim // 2


def test_forward_backward_on_image_and_text(tiny_dir: Path, demo_dir: Path):
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor, Qwen3VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_dir)
    assert type(processor.image_processor).__name__.startswith("Qwen2VLImageProcessor")
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(AutoConfig.from_pretrained(tiny_dir))
    model.train()

    samples = json.loads((demo_dir / "demo.json").read_text())
    sample = next(s for s in samples if len(s["images"]) == 1)
    image = Image.open(demo_dir / sample["images"][0]).convert("RGB")
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": [{"type": "text", "text": sample["messages"][1]["content"]}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    batch = processor(text=[text], images=[image], return_tensors="pt")
    n_img_tokens = int((batch["input_ids"] == model.config.image_token_id).sum())
    assert n_img_tokens == int(batch["image_grid_thw"].prod()) // 4 == (image.width // 32) * (image.height // 32)

    out = model(**batch, labels=batch["input_ids"].clone())
    assert torch.isfinite(out.loss)
    assert abs(out.loss.item() - torch.log(torch.tensor(float(model.config.text_config.vocab_size)))) < 1.0
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["model.visual.patch_embed.proj.weight"].abs().sum() > 0
    assert grads["model.language_model.embed_tokens.weight"].abs().sum() > 0
    assert grads["lm_head.weight"].abs().sum() > 0

    # the saved random weights load as well
    loaded = Qwen3VLForConditionalGeneration.from_pretrained(tiny_dir)
    with torch.no_grad():
        assert torch.isfinite(loaded(**batch).logits).all()


def test_demo_data_deterministic(demo_dir: Path, tmp_path: Path):
    again = tmp_path / "again"
    write_demo_dataset(again, num_samples=200, seed=0, image_fraction=0.5)
    assert _tree_hashes(again) == _tree_hashes(demo_dir)
    other = tmp_path / "other"
    write_demo_dataset(other, num_samples=200, seed=1, image_fraction=0.5)
    assert (other / "demo.json").read_bytes() != (demo_dir / "demo.json").read_bytes()


def test_demo_data_shape_and_heavy_tail(demo_dir: Path):
    from PIL import Image

    info = json.loads((demo_dir / "dataset_info.json").read_text())
    attr = info["odb_demo"]
    assert attr["formatting"] == "sharegpt" and attr["file_name"] == "demo.json"
    assert attr["columns"] == {"messages": "messages", "images": "images"}
    assert attr["tags"]["user_tag"] == "user" and attr["tags"]["assistant_tag"] == "assistant"

    samples = json.loads((demo_dir / "demo.json").read_text())
    assert len(samples) == 200
    sizes = set()
    for s in samples:
        roles = [m["role"] for m in s["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
        assert sum(m["content"].count("<image>") for m in s["messages"]) == len(s["images"])
        for p in s["images"]:
            with Image.open(demo_dir / p) as im:
                sizes.add(im.size)
    n_img = sum(1 for s in samples if s["images"])
    assert 0.35 < n_img / len(samples) < 0.65
    assert len(sizes) >= 4 and min(sizes)[0] == 64 and max(w * h for w, h in sizes) == 256 * 256

    stats = json.loads((demo_dir / "demo_stats.json").read_text())
    lengths = [sum(len(m["content"]) for m in s["messages"]) for s in samples]
    med = statistics.median(lengths)
    assert max(lengths) > 8 * med  # long tail
    assert sum(1 for x in lengths if x < 2 * med) > 0.6 * len(lengths)  # many short ones
    assert stats["length_cv"] > 0.7 and stats["text_length_cv"] > 0.9


def test_llamafactory_encodes_and_collates_demo_samples(tiny_dir: Path, demo_dir: Path):
    """LF's per-sample SFT encoding (qwen3_vl_nothink) + its collator + one training step on the tiny model."""
    pytest.importorskip("llamafactory")
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_template_and_fix_tokenizer
    from llamafactory.data.processor.supervised import SupervisedDatasetProcessor
    from llamafactory.hparams import DataArguments, ModelArguments
    from llamafactory.model import load_tokenizer
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    model_args = ModelArguments(model_name_or_path=str(tiny_dir), image_max_pixels=256 * 256)
    data_args = DataArguments(template="qwen3_vl_nothink", cutoff_len=1024)
    tok_module = load_tokenizer(model_args)
    tokenizer, processor = tok_module["tokenizer"], tok_module["processor"]
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    encoder = SupervisedDatasetProcessor(
        template=template, tokenizer=tokenizer, processor=processor, data_args=data_args
    )

    samples = json.loads((demo_dir / "demo.json").read_text())
    with_images = [s for s in samples if s["images"]][:3]
    text_only = [s for s in samples if not s["images"]][:2]

    def encode(sample):
        msgs = [m for m in sample["messages"] if m["role"] != "system"]
        images = [str(demo_dir / p) for p in sample["images"]]
        ids, labels = encoder._encode_data_example(
            prompt=msgs[:-1], response=msgs[-1:], system=None, tools=None, images=images, videos=[], audios=[]
        )
        return {
            "input_ids": ids,
            "attention_mask": [1] * len(ids),
            "labels": labels,
            "images": images,
            "videos": [],
            "audios": [],
        }

    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(AutoConfig.from_pretrained(tiny_dir))
    image_token = model.config.image_token_id
    collator = SFTDataCollatorWith4DAttentionMask(
        template=template,
        model=model,
        pad_to_multiple_of=8,
        label_pad_token_id=-100,
        compute_dtype=torch.float32,
        **tok_module,
    )
    for batch_samples in (with_images, text_only):  # text-only batches get LF's fake 64x64 image
        feats = [encode(s) for s in batch_samples]
        expected_vision = sum(_vision_tokens(demo_dir / p) for s in batch_samples for p in s["images"])
        assert sum(f["input_ids"].count(image_token) for f in feats) == expected_vision
        batch = collator(feats)
        assert batch["position_ids"].shape[:2] == (4, len(feats))  # text row + 3 M-RoPE rows
        assert batch["image_grid_thw"].shape[0] == max(1, sum(len(s["images"]) for s in batch_samples))
        loss = model(**batch).loss
        assert torch.isfinite(loss)
        loss.backward()


def _vision_tokens(path: Path) -> int:
    """Merged vision tokens of one demo image for the tiny model (sides are multiples of 32)."""
    from PIL import Image

    with Image.open(path) as im:
        return (im.width // 32) * (im.height // 32)
