"""How a sample's LLM length is counted, shared by the benchmark profiles (bench/workloads.py)
and the data preparation (`python -m odb_factory.data prepare`), so the numbers a user computes
on their data and the numbers the benchmark assumes come from one rule.

Vision tokens follow LLaMA-Factory + the Qwen3-VL processor: `image_grid(w, h)` gives the patch
grid of one image, `image_patches(w, h) // MERGE**2` its LLM tokens. The length statistics are
the two the paper's analysis rests on: the coefficient of variation and the short fraction f_s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

CUTOFF_LEN = 16384             # LLaMA-Factory cutoff_len of the paper's recipe
IMAGE_MAX_PIXELS = 589824      # LLaMA-Factory image_max_pixels (768 x 768)
PATCH = 16                     # Qwen3-VL vision patch size (pixels)
MERGE = 2                      # spatial merge: MERGE**2 patches -> one LLM token
FACTOR = PATCH * MERGE         # resized sides are multiples of 32 pixels
PROC_MIN_PIXELS = 65536        # Qwen3-VL image processor shortest_edge (min pixels)
PROC_MAX_PIXELS = 16777216     # Qwen3-VL image processor longest_edge (max pixels)
SHORT_TOKENS = 512             # f_s threshold: >= 24 such samples fit one 12,288-token budget


def length_cv(tokens: Sequence[float]) -> float:
    """Coefficient of variation std/mean (population std) of the LLM token counts."""
    t = np.asarray(tokens, dtype=np.float64)
    return float(t.std() / t.mean())


def short_fraction(tokens: Sequence[float], threshold: int = SHORT_TOKENS) -> float:
    """f_s: fraction of samples with at most `threshold` LLM tokens."""
    return float(np.mean(np.asarray(tokens) <= threshold))


def image_grid(width: int, height: int, max_pixels: int = IMAGE_MAX_PIXELS) -> tuple[int, int]:
    """(patch rows, patch cols) of one image as LLaMA-Factory + the Qwen3-VL processor see it.

    LLaMA-Factory first shrinks images above `image_max_pixels` (keeping the aspect ratio,
    truncating to whole pixels); the processor then rounds both sides to multiples of 32 px
    inside [PROC_MIN_PIXELS, PROC_MAX_PIXELS]. Patches = rows * cols, LLM tokens = patches / 4.
    """
    if width * height > max_pixels:
        f = math.sqrt(max_pixels / (width * height))
        width, height = int(width * f), int(height * f)
    h = max(FACTOR, round(height / FACTOR) * FACTOR)
    w = max(FACTOR, round(width / FACTOR) * FACTOR)
    if h * w > PROC_MAX_PIXELS:
        beta = math.sqrt(height * width / PROC_MAX_PIXELS)
        h = max(FACTOR, math.floor(height / beta / FACTOR) * FACTOR)
        w = max(FACTOR, math.floor(width / beta / FACTOR) * FACTOR)
    elif h * w < PROC_MIN_PIXELS:
        beta = math.sqrt(PROC_MIN_PIXELS / (height * width))
        h = math.ceil(height * beta / FACTOR) * FACTOR
        w = math.ceil(width * beta / FACTOR) * FACTOR
    return h // PATCH, w // PATCH


def image_patches(width: int, height: int, max_pixels: int = IMAGE_MAX_PIXELS) -> int:
    """Vision patches of one image (before the MERGE x MERGE merge into LLM tokens)."""
    rows, cols = image_grid(width, height, max_pixels)
    return rows * cols
