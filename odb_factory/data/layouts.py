"""Where each data set's files lie as published, and how to read them.

`--raw DIR` is the folder a download leaves (the `download` line of each layout), untouched:
the annotation files are found by their published names, the images under the folder the
published archives unpack to. What was checked, and where (see also docs/usage.md, "Preparing the
recipes' data"):

* ultrachat_200k (HuggingFaceH4/ultrachat_200k): parquet shards
  `data/train_sft-0000{0,1,2}-of-00003-<hash>.parquet` (split train_sft; the same folder holds
  test_sft, train_gen, test_gen, which are not read); columns prompt, prompt_id,
  messages[{content, role}] (the data set card's `dataset_info`).
* llava_instruct_150k (liuhaotian/LLaVA-Instruct-150K): `llava_instruct_150k.json`, one JSON
  list of {id, image: "000000033471.jpg", conversations[{from: human|gpt, value}]} with
  `<image>` in the text (the repository tree on the Hub; the first record as LLaVA-style
  training READMEs quote it: "<image>\\nWhat are the colors of the bus..."); images: COCO
  train2017 (images.cocodataset.org/zips/train2017.zip, unpacks to `train2017/`).
* llava_v1_5_mix665k (same repository, `llava_v1_5_mix665k.json`): image paths relative to
  LLaVA's `playground/data` (coco/train2017, gqa/images, ocr_vqa/images, textvqa/train_images,
  vg/VG_100K, vg/VG_100K_2, as the LLaVA README's "Visual Instruction Tuning" lays them out);
  rows without `image` are text only.
* sharegpt4o (OpenGVLab/ShareGPT-4o, gated on the Hub): the card's config `image_caption`,
  split `images`, is `image_conversations/gpt-4o.jsonl` (the video part,
  `video_conversations/gpt4o.jsonl`, is not used). Rows {image: "<file>.jpg", width, height,
  conversations[{from: human|gpt, value}]}, the LLaVA layout; images in `images.zip` at the
  repository root, which unpacks to `mnt/petrelfs/wangwenhai/workspace_cef/4o/image/<file>`.
  Sources: the card's YAML (configs); ms-swift's dataset registry (the ModelScope mirror's
  `images.zip`, the inner prefix, `image` -> images, human/gpt turns); a public build script
  of a fine-tuning mixture (`images/` + `image`, even turns alternating human/gpt, `<image>`
  in the text); an evaluation script quoting a live read of the columns and downloading
  `images.zip` from the Hub repository. Not verified against a record of the file itself (the
  set is gated), in particular that every row's text holds `<image>`
  (`formats.from_sharegpt4o` adds one where it is missing).
* alpaca_en (tatsu-lab/alpaca, MM-Mix only): `data/train-00000-of-00001-<hash>.parquet`,
  columns instruction, input, output, text.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from . import formats

SHAREGPT4O_IMAGES = "mnt/petrelfs/wangwenhai/workspace_cef/4o/image"


@dataclass(frozen=True)
class Layout:
    key: str                              # the CLI's name for the set
    name: str                             # registry name (recipes/data/dataset_info.json's)
    title: str
    repo: str                             # where it is published
    annotations: tuple[str, ...]          # glob patterns under --raw; the first that matches
    convert: Callable[[Mapping[str, Any]], formats.Row]
    image_roots: tuple[str, ...] = ()     # image folder under --raw: the first that exists
    download: str = ""                    # commands that produce the layout in RAW
    recipe: str = ""                      # a recipe to train on it (with dataset=<name>)

    @property
    def has_images(self) -> bool:
        return bool(self.image_roots)


LAYOUTS: dict[str, Layout] = {layout.key: layout for layout in (
    Layout("ultrachat", "ultrachat_200k", "UltraChat-200K", "HuggingFaceH4/ultrachat_200k",
           ("data/train_sft-*.parquet",), formats.from_ultrachat,
           download="hf download HuggingFaceH4/ultrachat_200k --repo-type dataset "
                    "--include 'data/train_sft-*' --local-dir RAW",
           recipe="recipes/qwen3vl_8b_odb_ultrachat.yaml"),
    Layout("llava150k", "llava_instruct_150k", "LLaVA-Instruct-150K",
           "liuhaotian/LLaVA-Instruct-150K", ("llava_instruct_150k.json",), formats.from_llava,
           image_roots=("coco/train2017", "train2017"),
           download="hf download liuhaotian/LLaVA-Instruct-150K "
                    "llava_instruct_150k.json --repo-type dataset --local-dir RAW; "
                    "unzip train2017.zip -d RAW/coco   "
                    "(http://images.cocodataset.org/zips/train2017.zip)",
           recipe="recipes/qwen3vl_8b_odb_llava.yaml"),
    Layout("llava665k", "llava_v1_5_mix665k", "LLaVA-665K", "liuhaotian/LLaVA-Instruct-150K",
           ("llava_v1_5_mix665k.json",), formats.from_llava, image_roots=(".",),
           download="hf download liuhaotian/LLaVA-Instruct-150K "
                    "llava_v1_5_mix665k.json --repo-type dataset --local-dir RAW; then the images "
                    "as LLaVA's README lays them out: RAW/coco/train2017, RAW/gqa/images, "
                    "RAW/ocr_vqa/images, RAW/textvqa/train_images, RAW/vg/VG_100K, RAW/vg/VG_100K_2",
           recipe="recipes/qwen3vl_8b_odb_llava.yaml"),
    Layout("sharegpt4o", "sharegpt4o", "ShareGPT-4o (images)", "OpenGVLab/ShareGPT-4o",
           ("image_conversations/gpt-4o.jsonl",), formats.from_sharegpt4o,
           image_roots=(SHAREGPT4O_IMAGES, "images"),
           download="hf download OpenGVLab/ShareGPT-4o --repo-type dataset "
                    "--include 'image_conversations/*' --include images.zip --local-dir RAW   (gated: accept "
                    "the terms on the Hub, then hf auth login); unzip RAW/images.zip -d RAW",
           recipe="recipes/qwen3vl_8b_odb.yaml"),
    Layout("alpaca", "alpaca_en", "Alpaca", "tatsu-lab/alpaca", ("data/train-*.parquet",),
           formats.from_alpaca,
           download="hf download tatsu-lab/alpaca --repo-type dataset "
                    "--include 'data/*' --local-dir RAW",
           recipe="recipes/qwen3vl_8b_odb_ultrachat.yaml"),
)}


class LayoutError(ValueError):
    """--raw does not hold a data set's files where its published layout puts them."""


def annotation_files(layout: Layout, raw: str) -> list[str]:
    """The set's annotation files under `raw`, sorted; the error names what was expected."""
    if not os.path.isdir(raw):
        raise LayoutError(f"{layout.title}: --raw {raw} is not a folder")
    for pattern in layout.annotations:
        found = sorted(glob.glob(os.path.join(raw, pattern)))
        if found:
            return found
    expected = " or ".join(os.path.join(raw, p) for p in layout.annotations)
    raise LayoutError(f"{layout.title} ({layout.repo}): expected {expected}, found nothing.\n"
                      f"  Download: {layout.download.replace('RAW', raw)}")


def image_root(layout: Layout, raw: str, override: str | None = None) -> str | None:
    """The folder the set's image paths are relative to (absolute), None for text sets."""
    if not layout.has_images:
        return None
    if override is not None:
        if not os.path.isdir(override):
            raise LayoutError(f"{layout.title}: --image-root {override} is not a folder")
        return os.path.abspath(override)
    for candidate in layout.image_roots:
        path = os.path.join(raw, candidate)
        if os.path.isdir(path):
            return os.path.abspath(path)
    expected = " or ".join(os.path.join(raw, c) for c in layout.image_roots)
    raise LayoutError(f"{layout.title}: expected the images under {expected}, found neither "
                      f"(or pass --image-root DIR).\n"
                      f"  Download: {layout.download.replace('RAW', raw)}")


def _json_array(path: str, chunk: int = 1 << 22) -> Iterator[Any]:
    """Items of a top-level JSON list, decoded one by one: the 665K file is 1 GB, and loading it
    whole would hold several times that in Python objects."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        buf, pos, eof, opened = "", 0, False, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(buf) - 1 and not eof:  # keep at least one character after an item
                more = handle.read(chunk)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            if pos >= len(buf):
                raise ValueError(f"{path}: the JSON list is not closed")
            if not opened:
                if buf[pos] != "[":
                    raise ValueError(f"{path}: expected a JSON list of records")
                opened, pos = True, pos + 1
                continue
            if buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    raise
                item, end = None, -1
            if end == -1 or (end >= len(buf) and not eof):
                more = handle.read(chunk)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            pos = end


def _jsonl(path: str) -> Iterator[Any]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def _parquet(path: str) -> Iterator[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow comes with LLaMA-Factory's datasets
        raise LayoutError(f"reading {path} needs pyarrow (pip install pyarrow)") from exc
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        yield from batch.to_pylist()


def records(path: str) -> Iterator[Any]:
    """The records of one annotation file (.json list, .jsonl or .parquet), in file order."""
    if path.endswith(".parquet"):
        return _parquet(path)
    if path.endswith(".jsonl"):
        return _jsonl(path)
    return _json_array(path)


def where(path: str, index: int, raw: str) -> str:
    """A record's place in its file, as a person looks it up (a line number for JSONL)."""
    rel = os.path.relpath(path, raw)
    return f"{rel} line {index + 1}" if path.endswith(".jsonl") else f"{rel} record {index}"
