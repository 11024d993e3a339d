"""Workload profiles: per-sample LLM tokens, images and vision patches at paper scale.

A `Profile` is the only thing the simulation needs to know about a dataset: for every sample
its LLM tokens after the chat template and vision-token expansion (cut at `cutoff_len`), the
tokens of its text alone (what a text-only length cache would hold), its supervised tokens,
its image count, its vision patches and the sum of squared patches per image (the encoder's
attention cost). Every number below and where it comes from is in bench/README.md
("Workload profiles"); assumptions are marked there as such.

Plug in a real dataset with `profile_from_rows(name, [(tokens, images, patches), ...])`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Tuple

import numpy as np

# The counting rule (vision tokens, CV, f_s) lives in the package, so that
# `python -m odb_factory.data prepare` reports a user's data by the same rule; re-exported here.
from odb_factory.token_lengths import (  # noqa: F401
    CUTOFF_LEN,
    FACTOR,
    IMAGE_MAX_PIXELS,
    MERGE,
    PATCH,
    PROC_MAX_PIXELS,
    PROC_MIN_PIXELS,
    SHORT_TOKENS,
    image_grid,
    image_patches,
    length_cv,
    short_fraction,
)

from .solvers import bisect


@dataclass(frozen=True)
class Profile:
    name: str
    tokens: np.ndarray          # LLM tokens per sample (template + text + vision tokens, <= cutoff)
    text_tokens: np.ndarray     # the same without vision tokens (a text-only length cache)
    label_tokens: np.ndarray    # supervised tokens (assistant turns)
    images: np.ndarray          # images per sample
    patches: np.ndarray         # vision patches per sample (before the 2x2 merge)
    patch_sq: np.ndarray        # sum over the sample's images of patches**2
    token_budget: int = 12288   # L_max used for ODB / GMT / BMT / packing on this workload
    text_only: bool = True
    note: str = ""
    targets: dict = field(default_factory=dict)   # e.g. {"cv": 0.48}: what the generator aimed at

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def cv(self) -> float:
        return length_cv(self.tokens)

    @property
    def short_fraction(self) -> float:
        return short_fraction(self.tokens)

    def summary(self) -> dict:
        t = self.tokens
        return {"profile": self.name, "samples": len(self), "mean_tokens": float(t.mean()),
                "p50": float(np.percentile(t, 50)), "p99": float(np.percentile(t, 99)),
                "max": int(t.max()), "cv": self.cv, "f_s": self.short_fraction,
                "images_per_sample": float(self.images.mean()),
                "patches_per_image": float(self.patches.sum() / max(1, self.images.sum())),
                "vision_token_share": float(1 - self.text_tokens.sum() / t.sum()),
                "token_budget": self.token_budget, **{f"target_{k}": v for k, v in self.targets.items()}}


# ----------------------------------------------------------------------------- vision tokens
def _patches_for(sizes: np.ndarray) -> np.ndarray:
    """Vectorised `image_patches` over an (n, 2) array of (width, height), via a lookup cache."""
    out = np.empty(len(sizes), dtype=np.int64)
    cache: dict = {}
    for i, (w, h) in enumerate(sizes.tolist()):
        key = (w, h)
        if key not in cache:
            cache[key] = image_patches(w, h)
        out[i] = cache[key]
    return out


# ----------------------------------------------------------------------------- plug-in entry
def profile_from_rows(name: str, rows: Iterable[Tuple[int, int, int]], token_budget: int = 12288,
                      label_fraction: float = 0.6, cutoff: int = CUTOFF_LEN,
                      note: str = "user rows") -> Profile:
    """A profile from measured rows (llm_tokens, images, vision_patches), one per sample.

    `llm_tokens` must already include the vision tokens (patches / 4 per image for Qwen-VL);
    patches are assumed split evenly over a sample's images for the encoder's P**2 term.
    """
    arr = np.asarray(list(rows), dtype=np.int64).reshape(-1, 3)
    if arr.shape[0] == 0:
        raise ValueError("profile_from_rows needs at least one (tokens, images, patches) row")
    if (arr < 0).any() or (arr[:, 0] <= 0).any():
        raise ValueError("tokens must be > 0 and images/patches >= 0")
    tokens = np.minimum(arr[:, 0], cutoff)
    images, patches = arr[:, 1], arr[:, 2]
    vision_tokens = np.minimum(patches // (MERGE * MERGE), tokens - 1)
    per_image = np.where(images > 0, patches / np.maximum(images, 1), 0.0)
    patch_sq = np.rint(images * per_image ** 2).astype(np.int64)
    text = tokens - vision_tokens
    return Profile(name, tokens, text, np.maximum(1, (text * label_fraction).astype(np.int64)),
                   images, patches, patch_sq, token_budget, bool(images.sum() == 0), note)


# ----------------------------------------------------------------------------- calibration
def _solve_lognormal(z: np.ndarray, base: np.ndarray, total_mean: float, total_cv: float,
                     lo: int, hi: int) -> np.ndarray:
    """Text lengths exp(mu + sigma z), clipped to [lo, hi - base], such that base + text has
    the target mean and CV (nested bisection; deterministic for a given z)."""
    room = np.maximum(lo, hi - base)

    def text(mu: float, sigma: float) -> np.ndarray:
        return np.clip(np.exp(mu + sigma * z), lo, room)

    def mu_for(sigma: float) -> float:
        return bisect(lambda m: (base + text(m, sigma)).mean() < total_mean, -5.0, 15.0, 60)

    s = bisect(lambda s: length_cv(base + text(mu_for(s), s)) < total_cv, 1e-3, 3.0, 40)
    return np.rint(text(mu_for(s), s)).astype(np.int64)


def _assemble(name: str, text: np.ndarray, images: np.ndarray, patches: np.ndarray,
              patch_sq: np.ndarray, label_share: float, budget: int, note: str,
              targets: dict) -> Profile:
    vision_tokens = patches // (MERGE * MERGE)
    tokens = np.minimum(text + vision_tokens, CUTOFF_LEN)
    text = tokens - vision_tokens  # LLaMA-Factory truncates text, never vision tokens
    labels = np.maximum(1, np.rint(text * label_share)).astype(np.int64)
    return Profile(name, tokens.astype(np.int64), text.astype(np.int64), labels,
                   images.astype(np.int64), patches.astype(np.int64), patch_sq.astype(np.int64),
                   budget, bool(images.sum() == 0), note, targets)


FAMILIES = ("lognormal", "log-logistic", "log-gamma")


def _draws(rng: np.random.Generator, n: int, family: str) -> np.ndarray:
    """Unit-variance draws whose exponential shapes the text lengths: standard normal
    (lognormal lengths, the nominal family), logistic (heavier right tail) or a standardised
    log-gamma(2) (lighter right tail). `_solve_lognormal` fits the same mean and CV to any."""
    if family == "lognormal":
        return rng.standard_normal(n)
    if family == "log-logistic":
        return rng.logistic(0.0, np.sqrt(3.0) / np.pi, size=n)
    if family == "log-gamma":
        x = np.log(rng.gamma(2.0, size=n))
        return (x - x.mean()) / x.std()
    raise ValueError(f"unknown length family {family!r}; one of {FAMILIES}")


# ----------------------------------------------------------------------------- paper workloads
# `family` and `mean_scale` vary the assumed shape and mean (bench.sensitivity); the defaults
# are the nominal profiles.
def ultrachat(n: int, seed: int = 0, family: str = "lognormal", mean_scale: float = 1.0) -> Profile:
    """UltraChat-200K: text only, mean 1,350 LLM tokens (derived), CV 0.48 (paper)."""
    rng = np.random.default_rng([seed, 1])
    z = _draws(rng, n, family)
    zeros = np.zeros(n, dtype=np.int64)
    text = _solve_lognormal(z, zeros, 1350.0 * mean_scale, 0.48, 24, CUTOFF_LEN)
    return _assemble("UltraChat-200K", text, zeros, zeros, zeros, 0.75, 12288,
                     "text; lognormal, mean 1,350 (derived), CV 0.48 (paper)",
                     {"cv": 0.48, "mean": 1350})


def _coco_sizes(n: int, rng: np.random.Generator) -> np.ndarray:
    """COCO-like image sizes: longer side 640 px, the other 360..640 (mostly 480 / 427)."""
    short = rng.choice([480, 427, 424, 426, 360, 640, 512, 500], size=n,
                       p=[0.42, 0.22, 0.06, 0.06, 0.06, 0.06, 0.06, 0.06])
    portrait = rng.random(n) < 0.25
    w = np.where(portrait, short, 640)
    h = np.where(portrait, 640, short)
    return np.stack([w, h], axis=1)


def llava(n: int, seed: int = 0, family: str = "lognormal", mean_scale: float = 1.0) -> Profile:
    """LLaVA-Instruct-150K: one COCO image each (~300 tokens), text mean ~240, total CV 0.29."""
    rng = np.random.default_rng([seed, 2])
    patches = _patches_for(_coco_sizes(n, rng))
    z = _draws(rng, n, family)
    base = patches // (MERGE * MERGE)
    text = _solve_lognormal(z, base, 540.0 * mean_scale, 0.29, 20, CUTOFF_LEN)
    ones = np.ones(n, dtype=np.int64)
    return _assemble("LLaVA-Instruct-150K", text, ones, patches, patches ** 2, 0.55, 12288,
                     "1 COCO image/sample; total mean 540 (assumption), CV 0.29 (paper)",
                     {"cv": 0.29, "mean": 540})


def _web_sizes(n: int, rng: np.random.Generator, large_share: float) -> np.ndarray:
    """Image sizes of web/SA-style collections: `large_share` above 0.6 MP (hit the cap)."""
    aspect = np.exp(rng.uniform(np.log(0.56), np.log(1.78), size=n))
    large = rng.random(n) < large_share
    mp = np.where(large, rng.uniform(0.8e6, 4.0e6, size=n), rng.uniform(0.08e6, 0.55e6, size=n))
    w = np.sqrt(mp * aspect)
    h = mp / w
    return np.stack([np.rint(w), np.rint(h)], axis=1).astype(np.int64)


def sharegpt4o(n: int, seed: int = 0, family: str = "lognormal", mean_scale: float = 1.0) -> Profile:
    """ShareGPT-4o (57K images): one image each, mostly capped at ~576 tokens, text long tail.
    Total mean 2,000 (assumption), CV 1.00 (paper)."""
    rng = np.random.default_rng([seed, 3])
    patches = _patches_for(_web_sizes(n, rng, 0.8))
    z = _draws(rng, n, family)
    text = _solve_lognormal(z, patches // (MERGE * MERGE), 2000.0 * mean_scale, 1.00, 30, CUTOFF_LEN)
    ones = np.ones(n, dtype=np.int64)
    return _assemble("ShareGPT-4o-57K", text, ones, patches, patches ** 2, 0.85, 14336,
                     "1 image/sample (80% at the 0.59 MP cap); total mean 2,000 (assumption), "
                     "CV 1.00 (paper)", {"cv": 1.00, "mean": 2000})


def mm_mix(n: int, seed: int = 0, short_share: float = 0.6, cv: float = 0.95,
           family: str = "lognormal") -> Profile:
    """MM-Mix: `short_share` short OCR/VQA/caption samples (one small image, a few words),
    30% single-image conversations, the rest a multi-image (2-4) tail whose text mean is solved
    so the whole mix has the target CV. All assumptions: the production mix is not public; the
    paper only says "many short samples (high f_s), lower CV than ShareGPT-4o (1.00)"."""
    rng = np.random.default_rng([seed, 4])
    kind = rng.choice(3, size=n, p=[short_share, 0.3, 1 - short_share - 0.3])
    # short: crops / screenshots / small photos, 0.03-0.4 MP (64..~300 tokens, 64 is the floor)
    small = np.stack([rng.integers(200, 700, size=n), rng.integers(150, 560, size=n)], axis=1)
    single = _web_sizes(n, rng, 0.5)
    p_one = _patches_for(np.where((kind == 0)[:, None], small, single))
    images = np.where(kind == 2, rng.integers(2, 5, size=n), 1)
    patches = p_one * images
    patch_sq = images * p_one ** 2
    vision = patches // (MERGE * MERGE)
    text = np.where(kind == 0, rng.integers(16, 90, size=n),
                    np.rint(np.exp(rng.normal(np.log(300), 0.6, size=n)))).astype(np.int64)
    # One long document per 40k samples (8k-13k tokens): the longest sample is what makes a
    # fixed batch OOM-unsafe above 1, as in any production mix.
    docs = np.zeros(n, dtype=bool)
    docs[rng.choice(n, size=max(1, n // 40000), replace=False)] = True
    text = np.where(docs, rng.integers(8000, 13000, size=n), text)
    z = _draws(rng, n, family)
    tail = (kind == 2) & ~docs

    def with_tail(mean: float) -> np.ndarray:
        t = text.copy()
        t[tail] = np.rint(np.exp(np.log(mean) + 0.8 * z[tail] - 0.32))
        return np.maximum(16, t)  # at least the chat template's own tokens

    # Solve the tail's text mean so the whole mix reaches the target CV (CV grows with it).
    text = with_tail(bisect(lambda m: length_cv(np.minimum(vision + with_tail(m), CUTOFF_LEN)) < cv,
                            1.0, 8000.0, 50, geometric=True))
    return _assemble("MM-Mix", text, images, patches, patch_sq, 0.5, 12288,
                     f"mix: {short_share:.0%} short OCR/VQA/caption, 30% single-image chat, "
                     f"rest 2-4 image tail, 1 in 40k an 8k-13k document; CV {cv} (assumption)",
                     {"cv": cv, "f_s": short_share})


# ----------------------------------------------------------------------------- sweeps
def generated_cv(n: int, cv: float, mean: float = 1350.0, seed: int = 0) -> Profile:
    """Text-only lognormal with a chosen CV (the speedup-vs-CV sweep)."""
    rng = np.random.default_rng([seed, 5, int(cv * 1000)])
    zeros = np.zeros(n, dtype=np.int64)
    text = _solve_lognormal(rng.standard_normal(n), zeros, mean, cv, 16, CUTOFF_LEN)
    return _assemble(f"gen CV {cv:.2f}", text, zeros, zeros, zeros, 0.7, 12288,
                     "generated lognormal", {"cv": cv, "mean": mean})


def generated_fs(n: int, f_s: float, seed: int = 0) -> Profile:
    """Text-only mixture: a share `f_s` of short samples (lognormal mean 160) and a long
    component (lognormal mean 2,000, CV 0.8): the speedup-vs-short-fraction sweep."""
    rng = np.random.default_rng([seed, 6, int(f_s * 1000)])
    short = rng.random(n) < f_s
    s_sig, l_sig = math.sqrt(math.log(1 + 0.5 ** 2)), math.sqrt(math.log(1 + 0.8 ** 2))
    z = rng.standard_normal(n)
    text = np.where(short, np.exp(np.log(160) - s_sig ** 2 / 2 + s_sig * z),
                    np.exp(np.log(2000) - l_sig ** 2 / 2 + l_sig * z))
    text = np.clip(np.rint(text), 16, CUTOFF_LEN).astype(np.int64)
    zeros = np.zeros(n, dtype=np.int64)
    return _assemble(f"gen f_s {f_s:.2f}", text, zeros, zeros, zeros, 0.7, 12288,
                     "generated short/long mixture", {"f_s": f_s})


PAPER_WORKLOADS = {
    "UltraChat-200K": ultrachat,
    "LLaVA-Instruct-150K": llava,
    "ShareGPT-4o-57K": sharegpt4o,
    "MM-Mix": mm_mix,
}


def paper_profiles(n: int, seed: int = 0) -> dict:
    return {name: make(n, seed) for name, make in PAPER_WORKLOADS.items()}
