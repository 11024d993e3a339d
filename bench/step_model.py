"""Step-time model of the benchmark: the model itself lives in the package
(`odb_factory.simulation.step_model`, shared with `python -m odb_factory.dry_run`); this module
re-exports it and adds the NNLS fit of its form to measured rows.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, NamedTuple, Sequence

import numpy as np

from odb_factory.simulation.step_model import (  # noqa: F401
    DEFAULT_MFU,
    GB,
    H20_1NODE,
    H20_2NODES,
    MODELS,
    QWEN3_VL_2B,
    QWEN3_VL_8B,
    StepModel,
    build_step_model,
)

from .solvers import scaled_nnls


# ----------------------------------------------------------------------------- fitting
FIT_COLUMNS = ("tokens", "sum_sq", "images", "patches", "patch_sq")


class FitResult(NamedTuple):
    coef: Dict[str, float]          # c0 and one coefficient per FIT_COLUMNS entry, all >= 0
    predicted: np.ndarray
    measured: np.ndarray
    rel_error: np.ndarray           # (pred - meas) / meas
    mape: float                     # mean |rel_error|
    r2: float

    def as_rows(self) -> List[dict]:
        return [{"measured_s": float(m), "predicted_s": float(p), "rel_error": float(e)}
                for m, p, e in zip(self.measured, self.predicted, self.rel_error)]


def _design(rows: Sequence[Mapping[str, float]]) -> np.ndarray:
    cols = [[1.0] * len(rows)] + [[float(r.get(c, 0.0)) for r in rows] for c in FIT_COLUMNS]
    return np.asarray(cols, dtype=np.float64).T


def fit_step_model(rows: Iterable[Mapping[str, float]], time_key: str = "time_s") -> FitResult:
    """Fit time = c0 + a*tokens + b*sum_sq + v0*images + va*patches + vb*patch_sq (all >= 0)
    to measured rows (dicts with those keys; missing vision keys count as 0) by scipy nnls.

    Columns are scaled to unit norm before the solve so that tokens (~1e3) and sum_sq
    (~1e7) are treated alike; the returned coefficients are in the rows' own units.
    """
    rows = list(rows)
    if len(rows) < 2:
        raise ValueError("fit_step_model needs at least two measured rows")
    x = _design(rows)
    y = np.asarray([float(r[time_key]) for r in rows], dtype=np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and (x >= 0).all() and (y >= 0).all()):
        raise ValueError("measured rows must be finite and non-negative")
    coef = scaled_nnls(x, y)
    pred = x @ coef
    rel = np.where(y > 0, (pred - y) / np.where(y > 0, y, 1.0), 0.0)
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    names = ("c0",) + FIT_COLUMNS
    return FitResult(dict(zip(names, map(float, coef))), pred, y, rel,
                     float(np.mean(np.abs(rel))), r2)


def describe(m: StepModel) -> Dict[str, float]:
    """Human-scale numbers of a step model (for the report)."""
    return {"model": m.name, "world": m.world, "c0_ms": m.c0 * 1e3,
            "tokens_per_s_per_gpu": 1.0 / m.a, "attn_share_at_4k": m.b * 4096 / (m.a + m.b * 4096),
            "vision_ms_per_576tok_image": float(m.vision_seconds(1, 2304, 2304 ** 2)) * 1e3,
            "reduce_scatter_ms": m.comm_micro_s * 1e3, "all_gather_ms": m.comm_opt_s * 1e3,
            "optimizer_ms": m.optimizer_s * 1e3, "static_GB": m.static_bytes / GB,
            "MB_per_token": m.bytes_per_token / 1e6, "cap_tokens": m.cap_tokens}
