"""The length statistics the benchmark's workload profiles are built on, for a prepared set.

A row's LLM tokens are counted as LLaMA-Factory builds them for Qwen3-VL with the recipes'
template `qwen3_vl_nothink`: each turn inside its template slot, every `<image>` expanded to
`<|vision_start|>`, patches/4 image tokens (`odb_factory.token_lengths.image_patches` from
the image's size, at the run's `image_max_pixels`) and `<|vision_end|>`; then cut at
`cutoff_len` (LLaMA-Factory cuts text, never vision tokens). Text is counted with a given
tokenizer slot by slot, as LLaMA-Factory encodes it, or else estimated as UTF-8 bytes / 4 of
the rendered conversation, the rule bench/demo_workload.py uses (a Qwen-like BPE averages
about 4 bytes per English token).

The summary has the keys of the benchmark's `Profile.summary()` (samples, mean_tokens, cv,
f_s, vision_token_share, ...), so a prepared set compares line by line with the profiles in
bench/README.md ("Workload profiles").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from odb_factory.token_lengths import MERGE, SHORT_TOKENS, length_cv, short_fraction

from .formats import IMAGE

# LLaMA-Factory 0.9.5's qwen3_vl_nothink slots (the user slot opens the assistant's turn).
SLOTS = {"system": "<|im_start|>system\n{}<|im_end|>\n",
         "user": "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
         "assistant": "{}<|im_end|>\n"}
VISION_MARKERS = ("<|vision_start|>", "<|vision_end|>")  # around each image's tokens

ESTIMATE_RULE = ("estimate: UTF-8 bytes / 4 of the conversation rendered in qwen3_vl_nothink's "
                 "template (pass --tokenizer DIR to count with a tokenizer)")


def pieces(messages: Sequence[dict[str, Any]], image_marker: str) -> list[str]:
    """The strings LLaMA-Factory encodes one by one, with each `<image>` as `image_marker`."""
    return [SLOTS[m["role"]].format(m["content"].replace(IMAGE, image_marker)) for m in messages]


class EstimateCounter:
    """Text tokens without a tokenizer: bytes / 4, plus the two vision markers per image."""

    rule = ESTIMATE_RULE

    def __call__(self, messages: Sequence[dict[str, Any]], images: int) -> int:
        size = sum(len(p.encode("utf-8")) for p in pieces(messages, ""))
        return max(1, round(size / 4)) + len(VISION_MARKERS) * images


class TokenizerCounter:
    """Text tokens with a local Hugging Face tokenizer, slot by slot (no special tokens added),
    the vision markers as the tokenizer's own tokens where it has them."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        vocab = self.tokenizer.get_vocab()
        self.marker = "".join(VISION_MARKERS) if all(m in vocab for m in VISION_MARKERS) else ""
        self.rule = f"tokenizer {path}"

    def __call__(self, messages: Sequence[dict[str, Any]], images: int) -> int:
        ids = self.tokenizer(pieces(messages, self.marker), add_special_tokens=False)["input_ids"]
        extra = 0 if self.marker else len(VISION_MARKERS) * images
        return sum(len(i) for i in ids) + extra


def counter(tokenizer: str | None):
    return TokenizerCounter(tokenizer) if tokenizer else EstimateCounter()


def summarize(name: str, text_tokens: Sequence[int], images: Sequence[int],
              patches: Sequence[int], cutoff_len: int) -> dict[str, Any]:
    """Profile-style statistics of one set: per row its text tokens (template and vision
    markers included), image count and vision patches."""
    text = np.asarray(text_tokens, dtype=np.int64)
    vision = np.asarray(patches, dtype=np.int64) // (MERGE * MERGE)
    total = text + vision
    tokens = np.minimum(total, cutoff_len)
    kept_text = np.maximum(tokens - vision, 0)
    n_images = np.asarray(images, dtype=np.int64)
    if len(tokens) == 0:
        return {"profile": name, "samples": 0}
    return {"profile": name, "samples": len(tokens), "mean_tokens": float(tokens.mean()),
            "p50": float(np.percentile(tokens, 50)), "p99": float(np.percentile(tokens, 99)),
            "max": int(tokens.max()), "cv": length_cv(tokens), "f_s": short_fraction(tokens),
            "images_per_sample": float(n_images.mean()),
            "patches_per_image": float(np.sum(patches) / max(1, int(n_images.sum()))),
            "vision_token_share": float(1 - kept_text.sum() / max(1, int(tokens.sum()))),
            "over_cutoff": int((total > cutoff_len).sum())}


def table(summaries: Sequence[dict[str, Any]]) -> str:
    """The summaries as a small Markdown table."""
    head = ("| data set | rows | mean tokens | p99 | max | CV | f_s (<= "
            f"{SHORT_TOKENS}) | vision share | images/row | over cutoff |")
    columns = head.count("|") - 1
    lines = [head, "|" + "---|" * columns]
    for s in summaries:
        if not s.get("samples"):
            lines.append(f"| {s['profile']} | 0 |" + " |" * (columns - 2))
            continue
        lines.append(f"| {s['profile']} | {s['samples']:,} | {s['mean_tokens']:,.0f} | "
                     f"{s['p99']:,.0f} | {s['max']:,} | {s['cv']:.2f} | {s['f_s']:.2f} | "
                     f"{s['vision_token_share']:.2f} | {s['images_per_sample']:.2f} | "
                     f"{s['over_cutoff']:,} |")
    return "\n".join(lines)
