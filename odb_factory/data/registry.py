"""LLaMA-Factory's data set registry (`dataset_info.json`) for the prepared files, and the
MM-Mix stand-in's mixing keys.

Every prepared file has the same shape (`formats`), so every entry is the same: formatting
`sharegpt`, columns messages (and images), OpenAI-style role/content tags; LLaMA-Factory 0.9.5
reads these keys in `data/parser.py` (`DatasetAttr.join`). The entries keep the names of
recipes/data/dataset_info.json, so a recipe's `dataset:` works with `dataset_dir=<--out>`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

INFO_FILE = "dataset_info.json"   # LLaMA-Factory's DATA_CONFIG

TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user",
        "assistant_tag": "assistant", "system_tag": "system"}

# MM-Mix is not a published set: it is our public stand-in for the paper's (non-public)
# production mix, defined in recipes/parts/data/mm_mix.yaml with LLaMA-Factory's own mixing
# keys (tests/data checks that the two agree). Members by the CLI's names, in mixing order.
MIXTURE_MEMBERS = ("alpaca", "llava150k", "ultrachat", "sharegpt4o")
MIXTURE_KEYS = {"mix_strategy": "interleave_under", "interleave_probs": "0.4,0.3,0.2,0.1"}


def entry(file_name: str, has_images: bool) -> dict[str, Any]:
    """One registry entry for a prepared file (relative to dataset_dir)."""
    columns = {"messages": "messages"}
    if has_images:
        columns["images"] = "images"
    return {"file_name": file_name, "formatting": "sharegpt", "columns": columns,
            "tags": dict(TAGS)}


def merged(existing: Mapping[str, Any], entries: Mapping[str, Any]) -> dict[str, Any]:
    """`existing` with `entries` replacing theirs, so sets prepared one by one into the same
    folder share one registry."""
    return {**existing, **entries}


def write(out_dir: str, entries: Mapping[str, Any]) -> str:
    path = os.path.join(out_dir, INFO_FILE)
    existing: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            existing = json.load(handle)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(merged(existing, entries), handle, indent=2)
        handle.write("\n")
    return path


def train_keys(datasets: Sequence[str], dataset_dir: str, media_dir: str | None,
               mixture: bool = False) -> dict[str, str]:
    """The `key=value` overrides that train on the prepared data, in LLaMA-Factory's names."""
    keys = {"dataset": ",".join(datasets), "dataset_dir": dataset_dir}
    if media_dir is not None:
        keys["media_dir"] = media_dir
    if mixture:
        keys.update(MIXTURE_KEYS)
    return keys


def yaml_fragment(keys: Mapping[str, str], comment: str) -> str:
    """The keys as a recipe fragment (flat YAML; a value is quoted where YAML would misread it)."""
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += [f"{k}: {json.dumps(v) if any(c in v for c in ':#') or v != v.strip() else v}"
              for k, v in keys.items()]
    return "\n".join(lines) + "\n"
