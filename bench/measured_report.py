"""The measured layer in the report: the per-step rows the CPU runs leave in
`measured_rows.csv`, and the step model fitted to those rows (predicted vs measured)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterable, List, Mapping

from .plots import pyplot, save
from .step_model import FIT_COLUMNS, fit_step_model
from .tables import md_table, write_csv

MEASURED_COLUMNS = ["label", "tokens", "sum_sq", "images", "patches", "patch_sq", "time_s"]


def read_measured_rows(path: Path) -> List[dict]:
    with open(path) as fh:
        return [{k: (float(v) if k != "label" else v) for k, v in r.items() if v not in ("", None)}
                for r in csv.DictReader(fh)]


def write_measured_rows(records: Iterable[Mapping], path: Path) -> None:
    """ODB's per-step ledger records as step-model rows. The ledger has no per-image counts:
    images and patch_sq stay blank (not measured)."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, MEASURED_COLUMNS)
        writer.writeheader()
        for rec in records:
            writer.writerow({"label": "odb cpu", "tokens": rec["padded_tokens"], "sum_sq": rec["attention_cost"],
                             "patches": rec["vision_patches"], "time_s": rec["seconds"]})


def add_measured_rows(rows: Iterable[Mapping[str, float]], out_dir: Path,
                      time_key: str = "time_s") -> str:
    """Hook for the measured layer: rows of (tokens, sum_sq, images, patches, patch_sq,
    time_s) measured per micro-batch (e.g. from llamafactory-cli runs on CPU). Fits the step
    model's form with NNLS, writes measured_fit.csv and measured_vs_predicted.png, and returns
    the report section (coefficients, error, per-row table)."""
    rows = list(rows)
    fit = fit_step_model(rows, time_key)
    out_dir = Path(out_dir)
    table = [{**{k: r.get(k) for k in ("label",) + FIT_COLUMNS if k in r}, **d}
             for r, d in zip(rows, fit.as_rows())]
    write_csv(out_dir / "measured_fit.csv", table)
    fig, ax = pyplot().subplots(figsize=(4.2, 4.0))
    ax.scatter(fit.measured, fit.predicted, s=12)
    hi = max(float(fit.measured.max()), float(fit.predicted.max())) * 1.05
    ax.plot([0, hi], [0, hi], color="k", lw=0.8)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted (s)")
    ax.set_title(f"NNLS fit: MAPE {fit.mape:.1%}, R² {fit.r2:.3f}", fontsize=9)
    save(fig, out_dir / "measured_vs_predicted.png")
    coef = ", ".join(f"{k}={v:.4g}" for k, v in fit.coef.items())
    return "\n".join([
        "## Measured layer: step model fitted to measured rows",
        f"{len(rows)} rows; time = c0 + tokens·a + Σl²·b + images·v0 + patches·va + ΣP²·vb, "
        f"non-negative least squares: {coef}.",
        f"Mean |predicted − measured| / measured = {fit.mape:.1%}; R² = {fit.r2:.3f}. "
        "Plot: `measured_vs_predicted.png`; rows: `measured_fit.csv`.", "",
        md_table(table[:40], [(k, k) for k in table[0].keys()])])
