"""Per-sample cost of one model stage as a function of its token count l.

cost(l) = c0 + a*l + b*l**2: the linear term covers the dense layers (~2 * params FLOPs per
token forward), the quadratic term covers attention scores and their application (~4 * l**2 *
d_attn per layer forward, halved for causal masks). The defaults are in *relative units*
(1.0 = dense LLM FLOPs of one text token), derived from the architecture as described in
docs/balancing.md; they only need to be right up to a common factor. For measured kernels use
``fit_stage_cost_model`` on timings.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import nnls


@dataclass(frozen=True)
class StageCostModel:
    c0: float = 0.0
    a: float = 1.0
    b: float = 0.0

    def __post_init__(self) -> None:
        for name in ("c0", "a", "b"):
            v = getattr(self, name)
            real = isinstance(v, numbers.Real) and not isinstance(v, bool)
            if not (real and math.isfinite(v) and v >= 0):
                raise ValueError(f"StageCostModel.{name} must be finite and >= 0, got {v!r}")

    def __call__(self, lengths: ArrayLike) -> np.ndarray | float:
        """Vectorised; non-negative coefficients make it non-decreasing for l >= 0."""
        arr = np.asarray(lengths, dtype=np.float64)  # pragma: no mutate, float coefficients promote
        out = self.c0 + arr * (self.a + self.b * arr)
        return float(out) if out.ndim == 0 else out


# Qwen3-VL-8B LLM (Qwen3-8B: ~6.95e9 non-embedding params, 36 layers, 32 x 128 query dims):
# dense 2 * 6.95e9 FLOPs/token = the unit; causal attention 2 * 36 * 4096 = 2.95e5 FLOPs/l**2.
QWEN3_VL_LLM = StageCostModel(c0=0.0, a=1.0, b=2.95e5 / 1.39e10)
# Vision tower (~0.4e9 params, 27 layers, width 1152), full attention within each image:
# dense 2 * 0.4e9 = 8e8 FLOPs/patch; attention 4 * 27 * 1152 = 1.24e5 FLOPs/l**2 (l = patches).
QWEN3_VL_VISION = StageCostModel(c0=0.0, a=8.0e8 / 1.39e10, b=1.24e5 / 1.39e10)
# The vision tower's per-patch work without its per-image attention term: what a sample's patch
# total alone can price. It cannot tell one large image from many small ones, and pricing the
# total as one image overestimates many.
VISION_BY_PATCH_TOTAL = StageCostModel(c0=0.0, a=QWEN3_VL_VISION.a, b=0.0)


class StageCostFit(NamedTuple):
    model: StageCostModel
    r2: float
    mean_rel_error: float  # mean |pred - t| / t over samples with t > 0


def fit_stage_cost_model(lengths: ArrayLike, times: ArrayLike) -> StageCostFit:
    """Least squares fit of (c0, a, b) >= 0 to measured (length, time) pairs (scipy nnls)."""
    # pragma: no mutate start, any negative reshape flattens; float coefficients promote
    l = np.asarray(lengths, dtype=np.float64).reshape(-1)
    t = np.asarray(times, dtype=np.float64).reshape(-1)
    # pragma: no mutate end
    if l.shape != t.shape:
        raise ValueError(f"lengths has {l.shape[0]} entries but times has {t.shape[0]}")
    if l.shape[0] == 0:
        raise ValueError("fit_stage_cost_model needs at least one (length, time) pair")
    for name, v in (("lengths", l), ("times", t)):
        if not np.all(np.isfinite(v) & (v >= 0)):
            raise ValueError(f"{name} must be finite and non-negative")
    x = np.stack([np.ones_like(l), l, l * l], axis=1)
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0  # pragma: no mutate, an all-zero column (all l == 0) gets coefficient 0 anyway
    coef, _ = nnls(x / scale, t)
    coef = coef / scale
    model = StageCostModel(float(coef[0]), float(coef[1]), float(coef[2]))
    pred = x @ coef
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    # pragma: no mutate start, a float-rounding-level threshold: any nearby one is the same
    noise = 1e-24 * max(1.0, float(np.sum(t * t)))
    constant = ss_tot <= noise
    # pragma: no mutate end
    # constant times: R^2 is undefined; c0 = t fits them exactly, so report 1
    r2 = 1.0 if constant else 1.0 - ss_res / ss_tot
    pos = t > 0
    mre = float(np.mean(np.abs(pred[pos] - t[pos]) / t[pos])) if pos.any() else 0.0
    return StageCostFit(model, r2, mre)
