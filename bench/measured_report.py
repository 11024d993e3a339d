"""The measured layer in the report: the CPU runs' section, the per-step rows they leave in
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


def measured_section(res: Mapping, start: Mapping[str, float]) -> str:
    """The CPU runs (bench.measured) and start-up figures (bench.startup) as report text."""
    lines = ["## Measured on this machine (2 CPU ranks, gloo, tiny Qwen3-VL)",
             f"Generated mixed text/image data, length CV {res['length_cv']:.2f}, 256 samples "
             f"(10% held out); {res['repeats']} repeats, Standard = batch 1 per device.", "",
             "| repeat | Standard samples/s | ODB samples/s | ODB / Standard | Standard eval loss | ODB eval loss "
             "| optimizer steps Standard / ODB |",
             "|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['repeat']} | {r['standard_samples_per_s']:.1f} | {r['odb_samples_per_s']:.1f} | "
                     f"{r['ratio']:.2f} | {r['standard_eval_loss']:.4f} | {r['odb_eval_loss']:.4f} | "
                     f"{r['standard_steps']} / {r['odb_steps']} |")
    lines += ["", f"ODB / Standard: mean {res['ratio_mean']:.2f}×, range {res['ratio_min']:.2f}–"
              f"{res['ratio_max']:.2f}× over {res['repeats']} repeats."]
    if "balance_samples_per_s" in res:
        lines.append(f"ODB + post-balancing: {res['balance_samples_per_s']:.1f} samples/s "
                     f"({res['balance_ratio_vs_odb']:.2f}× ODB); Sorted (group-by-length, batch 4): "
                     f"{res['sorted_samples_per_s']:.1f} samples/s, eval loss {res['sorted_eval_loss']:.4f} "
                     "(quality band: reported, not asserted).")
        std_loss, odb_loss = res["runs"][0]["standard_eval_loss"], res["runs"][0]["odb_eval_loss"]
        nearer = "ODB" if abs(res["matched_eval_loss"] - odb_loss) < abs(res["matched_eval_loss"] - std_loss) \
            else "batch-1 Standard"
        lines.append(f"Standard with batch {res['matched_batch']} (ODB's mean samples per micro-step): "
                     f"{res['matched_samples_per_s']:.1f} samples/s, {res['matched_steps']} optimizer steps, "
                     f"eval loss {res['matched_eval_loss']:.4f}, nearer {nearer}'s — the same learning rate "
                     "over fewer, larger optimizer steps is what this run isolates from the grouping.")
    fit = res["step_model"]
    lines += ["", "Step time ~ c0 + a·padded tokens + b·Σ n·L² + v·vision patches (each the slowest rank's) "
              f"fitted (NNLS) on {fit['steps_fitted']} ODB optimizer steps, "
              f"checked on {fit['steps_checked']} others: median |error| {fit['median_abs_pct_error']:.1f}%, "
              f"mean {fit['mean_abs_pct_error']:.1f}%.", "",
              "Start-up: " + ", ".join(f"{k} = {v:.3f}" for k, v in start.items()) + "."]
    return "\n".join(lines)


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
