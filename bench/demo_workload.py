"""The LLaMA-Factory demo sets as one real workload profile ("LF demo (real)").

The data are an optional input: `DEMO_DIR` (`../shared/data/llamafactory_demo` beside the
repository). Every reader of it (this module, `bench.engine`, `bench.balance_bench`) skips
its rows with a note when the folder is absent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence, Tuple

import numpy as np

from .workloads import MERGE, Profile, image_patches, profile_from_rows

DEMO_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "llamafactory_demo"


def _chatml(turns: Sequence[Tuple[str, str]]) -> str:
    """The conversation as Qwen's ChatML template renders it."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


def _demo_conversations(folder: Path):
    """(turns, image paths) of every demo sample, in LLaMA-Factory's roles."""
    out = []
    alpaca = folder / "alpaca_en_demo.json"
    if alpaca.exists():
        for row in json.loads(alpaca.read_text()):
            prompt = row["instruction"] + ("\n" + row["input"] if row.get("input") else "")
            out.append(([("user", prompt), ("assistant", row["output"])], []))
    glaive = folder / "glaive_toolcall_en_demo.json"
    if glaive.exists():
        roles = {"human": "user", "gpt": "assistant", "function_call": "assistant",
                 "observation": "tool"}
        for row in json.loads(glaive.read_text()):
            turns = [("system", row.get("tools", ""))] if row.get("tools") else []
            turns += [(roles.get(m["from"], m["from"]), m["value"]) for m in row["conversations"]]
            out.append((turns, []))
    mllm = folder / "mllm_demo.json"
    if mllm.exists():
        for row in json.loads(mllm.read_text()):
            turns = [(m["role"], m["content"].replace("<image>", "")) for m in row["messages"]]
            out.append((turns, [folder / p for p in row.get("images", [])]))
    return out


def _image_size(path: Path) -> Tuple[int, int]:
    try:
        from PIL import Image
        with Image.open(path) as im:
            return im.size
    except Exception:  # no PIL or unreadable: a typical 640 x 480 photo
        return (640, 480)


def demo_profile(n: Optional[int] = None, seed: int = 0, folder: Path = DEMO_DIR,
                 tokenizer_dir: Optional[Path] = None) -> Optional[Profile]:
    """The LLaMA-Factory demo sets as one real profile, or None when the folder is absent.

    Tokens: UTF-8 bytes of the ChatML-rendered conversation / 4 (a Qwen-like BPE averages
    ~4 bytes per English token), or, with `tokenizer_dir` (e.g. the tiny Qwen3-VL built by
    `odb_factory.demo.tiny_model.build_tiny_qwen3vl`), that tokenizer's exact count. Images:
    their real sizes through `image_grid`. With `n`, the 1,305 real samples are resampled with
    replacement (seeded) to n samples so the per-rank statistics are not dominated by 3 steps.
    """
    convs = _demo_conversations(Path(folder))
    if not convs:
        return None
    tok = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rows, labels = [], []
    size_cache: dict = {}
    for turns, images in convs:
        if tok is not None:
            text = len(tok(_chatml(turns))["input_ids"])
            answer = sum(len(tok(c)["input_ids"]) for r, c in turns if r == "assistant")
        else:
            text = max(1, round(len(_chatml(turns).encode("utf-8")) / 4))
            answer = max(1, round(sum(len(c.encode()) for r, c in turns if r == "assistant") / 4))
        p = 0
        for path in images:
            if path not in size_cache:
                size_cache[path] = image_patches(*_image_size(path))
            p += size_cache[path]
        rows.append((text + 2 * len(images) + p // (MERGE * MERGE), len(images), p))
        labels.append(answer)
    arr = np.asarray(rows, dtype=np.int64)
    lab = np.asarray(labels, dtype=np.int64)
    if n is not None:
        pick = np.random.default_rng([seed, 7]).integers(0, len(arr), size=n)
        arr, lab = arr[pick], lab[pick]
    name = "LF demo (real)" if tok is None else "LF demo (real, given tokenizer)"
    prof = profile_from_rows(name, [tuple(r) for r in arr.tolist()],
                             note="alpaca_en_demo + glaive_toolcall_en_demo + mllm_demo; "
                                  + ("tokenizer count" if tok is not None else "bytes/4"))
    return Profile(prof.name, prof.tokens, prof.text_tokens, np.minimum(lab, prof.tokens),
                   prof.images, prof.patches, prof.patch_sq, prof.token_budget, prof.text_only,
                   prof.note, {})
