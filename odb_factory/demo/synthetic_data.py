"""Generated mixed text/image SFT data in LLaMA-Factory's sharegpt format.

Everything is made up from a seed: words are built from syllables (Zipf-distributed use), lengths are
heavy-tailed (many short answers, a Pareto tail of long ones), images are drawn with PIL in a few sizes so
that vision-token counts differ from sample to sample. Nothing is downloaded or copied.

Layout written to ``out_dir``::

    dataset_info.json   registers the set (default name ``odb_demo``, sharegpt, messages/images columns)
    demo.json           the samples
    images/img_*.png    the images (paths in demo.json are relative to ``out_dir``, LF's default media_dir)
    demo_stats.json     the summary returned by :func:`write_demo_dataset` (less ``dataset_dir``)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

DATASET_NAME = "odb_demo"
DATA_FILE = "demo.json"
IMAGE_DIR = "images"

# (width, height) choices; every side is a multiple of 32 = patch 16 x merge 2, so the Qwen3-VL image
# processor keeps the size and an image costs (w/32)*(h/32) LLM tokens (4 .. 64).
IMAGE_SIZES: tuple[tuple[int, int], ...] = (
    (64, 64),
    (96, 64),
    (64, 128),
    (128, 128),
    (160, 96),
    (192, 192),
    (256, 128),
    (256, 256),
)
VISION_FACTOR = 32  # patch_size * merge_size of the tiny model

_ONSETS = ("", "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "kr", "st", "tr", "pl")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "", "", "n", "r", "s", "l", "m", "k", "th")


def make_lexicon(seed: int = 0, size: int = 3000) -> list[str]:
    """Return ``size`` distinct made-up words; index 0 is the most frequent under :class:`WordSampler`."""
    rng = random.Random(f"odb-lexicon-{seed}")
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < size:
        n_syl = rng.choices((1, 2, 3, 4), weights=(30, 40, 22, 8))[0]
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n_syl))
        if word not in seen:
            seen.add(word)
            words.append(word)
    # frequent words tend to be short, as in natural text
    words.sort(key=lambda w: len(w) + rng.random() * 6)
    return words


class WordSampler:
    """Zipf-like word sampler plus sentence/paragraph builders over a made-up lexicon."""

    def __init__(self, lexicon: list[str], exponent: float = 1.07):
        self.lexicon = lexicon
        weights = [1.0 / (rank + 2.7) ** exponent for rank in range(len(lexicon))]
        total = 0.0
        self._cum: list[float] = []
        for w in weights:
            total += w
            self._cum.append(total)

    def words(self, rng: random.Random, n: int) -> list[str]:
        return rng.choices(self.lexicon, cum_weights=self._cum, k=n)

    def text(self, rng: random.Random, n_words: int) -> str:
        """About ``n_words`` words as sentences (capitals, commas, numbers, full stops, paragraphs)."""
        out: list[str] = []
        remaining = max(1, n_words)
        sentences_in_par = 0
        while remaining > 0:
            k = min(remaining, max(2, int(rng.lognormvariate(math.log(11), 0.45))))
            ws = self.words(rng, k)
            if rng.random() < 0.15:
                ws[rng.randrange(k)] = str(rng.randrange(1, 2000))
            if k > 6 and rng.random() < 0.4:
                ws[rng.randrange(1, k - 1)] += ","
            ws[0] = ws[0].capitalize()
            end = rng.choices((".", "?", "!", ":"), weights=(80, 10, 5, 5))[0]
            out.append(" ".join(ws) + end)
            remaining -= k
            sentences_in_par += 1
            if remaining > 0 and sentences_in_par >= 4 and rng.random() < 0.35:
                out.append("\n\n")
                sentences_in_par = 0
            elif remaining > 0:
                out.append(" ")
        return "".join(out).replace(" \n\n ", "\n\n").strip()


def corpus_lines(seed: int = 0, num_lines: int = 4000) -> list[str]:
    """Generated text for training the tiny tokenizer (same lexicon as the data set)."""
    sampler = WordSampler(make_lexicon(seed))
    rng = random.Random(f"odb-corpus-{seed}")
    return [sampler.text(rng, int(rng.lognormvariate(math.log(20), 0.8)) + 1) for _ in range(num_lines)]


def _draw_image(path: Path, size: tuple[int, int], rng: random.Random) -> None:
    from PIL import Image, ImageDraw

    w, h = size
    c0 = [rng.randrange(256) for _ in range(3)]
    c1 = [rng.randrange(256) for _ in range(3)]
    horizontal = rng.random() < 0.5
    img = Image.new("RGB", (w, h))
    draw = ImageDraw.Draw(img)
    n = w if horizontal else h
    for k in range(n):  # one line per column/row: fast and exact
        t = k / max(1, n - 1)
        color = tuple(int(a + (b - a) * t) for a, b in zip(c0, c1))
        draw.line(((k, 0), (k, h - 1)) if horizontal else ((0, k), (w - 1, k)), fill=color)
    for _ in range(rng.randint(2, 7)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        x1, y1 = min(w - 1, x0 + rng.randint(4, w // 2)), min(h - 1, y0 + rng.randint(4, h // 2))
        color = tuple(rng.randrange(256) for _ in range(3))
        if rng.random() < 0.5:
            draw.rectangle((x0, y0, x1, y1), fill=color)
        else:
            draw.ellipse((x0, y0, x1, y1), fill=color)
    img.save(path, format="PNG", optimize=False)


def _answer_words(rng: random.Random) -> int:
    """Heavy-tailed answer length in words: mostly short (lognormal body), 20% Pareto tail."""
    if rng.random() < 0.8:
        n = rng.lognormvariate(math.log(14), 0.6)
    else:
        n = 30.0 * rng.paretovariate(1.2)
    return int(min(max(n, 2), 700))


def _estimated_tokens(sample: dict[str, Any], image_sizes: list[tuple[int, int]]) -> int:
    """Rough LLM-token cost: ~3.5 chars per token + 5 template tokens per turn + merged vision tokens."""
    text = sum(math.ceil(len(m["content"]) / 3.5) + 5 for m in sample["messages"])
    vision = sum((w // VISION_FACTOR) * (h // VISION_FACTOR) + 2 for w, h in image_sizes)
    return text + vision


def _cv(xs: list[float]) -> float:
    mean = statistics.fmean(xs)
    return statistics.pstdev(xs) / mean if mean else 0.0


def write_demo_dataset(
    out_dir: str | Path,
    num_samples: int = 512,
    seed: int = 0,
    image_fraction: float = 0.5,
    dataset_name: str = DATASET_NAME,
) -> dict[str, Any]:
    """Write the demo set to ``out_dir`` and return its summary (also saved as ``demo_stats.json``).

    Deterministic for ``(num_samples, seed, image_fraction)``: same bytes in every file. The summary has
    ``length_cv`` (coefficient of variation of the estimated per-sample token cost, vision included),
    ``text_length_cv`` (of the characters) and simple percentiles.
    """
    if num_samples < 1:
        raise ValueError("num_samples must be >= 1")
    if not 0.0 <= image_fraction <= 1.0:
        raise ValueError("image_fraction must be in [0, 1]")
    out = Path(out_dir)
    img_dir = out / IMAGE_DIR
    img_dir.mkdir(parents=True, exist_ok=True)
    for stale in img_dir.glob("img_*.png"):  # only files this generator names
        stale.unlink()

    sampler = WordSampler(make_lexicon(seed))
    rng = random.Random(f"odb-demo-{seed}")
    samples: list[dict[str, Any]] = []
    costs: list[int] = []
    chars: list[int] = []
    num_images = 0
    for i in range(num_samples):
        messages: list[dict[str, str]] = []
        images: list[str] = []
        sizes: list[tuple[int, int]] = []
        if rng.random() < 0.1:
            messages.append({"role": "system", "content": sampler.text(rng, rng.randint(4, 16))})
        n_img = 0
        if rng.random() < image_fraction:
            n_img = 2 if rng.random() < 0.15 else 1
        n_turns = rng.choices((1, 2, 3), weights=(75, 18, 7))[0]
        for turn in range(n_turns):
            question = sampler.text(rng, int(min(max(rng.lognormvariate(math.log(10), 0.6), 2), 120)))
            if turn == 0 and n_img:
                question = "<image>" * n_img + question if rng.random() < 0.7 else question + "<image>" * n_img
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": sampler.text(rng, _answer_words(rng))})
        for k in range(n_img):
            size = rng.choice(IMAGE_SIZES)
            name = f"{IMAGE_DIR}/img_{i:05d}_{k}.png"
            _draw_image(out / name, size, rng)
            images.append(name)
            sizes.append(size)
        num_images += n_img
        sample = {"messages": messages, "images": images}
        samples.append(sample)
        costs.append(_estimated_tokens(sample, sizes))
        chars.append(sum(len(m["content"]) for m in messages))

    with open(out / DATA_FILE, "w", encoding="utf-8") as f:
        json.dump(samples, f, ensure_ascii=False, indent=1)
        f.write("\n")

    register_dataset(out, dataset_name, DATA_FILE, {"messages": "messages", "images": "images"})

    srt = sorted(costs)
    stats = {
        "dataset_name": dataset_name,
        "num_samples": num_samples,
        "seed": seed,
        "image_fraction": image_fraction,
        "num_image_samples": sum(1 for s in samples if s["images"]),
        "num_images": num_images,
        "length_cv": round(_cv(costs), 4),
        "text_length_cv": round(_cv(chars), 4),
        "length_mean": round(statistics.fmean(costs), 2),
        "length_p50": srt[len(srt) // 2],
        "length_p90": srt[min(len(srt) - 1, (9 * len(srt)) // 10)],
        "length_max": srt[-1],
        "length_min": srt[0],
    }
    with open(out / "demo_stats.json", "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=2, sort_keys=True)
        f.write("\n")
    return {"dataset_dir": str(out), **stats}


def register_dataset(out: Path, name: str, data_file: str, columns: dict) -> None:
    """Register a sharegpt-format file (role/content messages) as `name` in `out`'s
    dataset_info.json, keeping the other registrations of a shared dataset_dir."""
    info_path = out / "dataset_info.json"
    info: dict[str, Any] = {}
    if info_path.is_file():
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    info[name] = {
        "file_name": data_file,
        "formatting": "sharegpt",
        "columns": columns,
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                 "assistant_tag": "assistant", "system_tag": "system"},
    }
    with open(info_path, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.write("\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write the generated odb_demo data set (LLaMA-Factory sharegpt).")
    p.add_argument("out_dir")
    p.add_argument("--num-samples", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-fraction", type=float, default=0.5)
    p.add_argument("--name", default=DATASET_NAME)
    a = p.parse_args(argv)
    stats = write_demo_dataset(a.out_dir, a.num_samples, a.seed, a.image_fraction, a.name)
    print(json.dumps(stats, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
