"""Markdown and CSV tables of the benchmark, in the paper's layout.

Pure formatting: every number comes from bench.simulate through bench.lab.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

from . import paper

METHODS: List[Tuple[str, str]] = [
    ("standard", "Standard bs=1"),
    ("standard_safe", "Standard OOM-safe bs"),
    ("standard_matched", "Standard tok/step matched"),
    ("sorted", "Sorted"),
    ("sorted_shuffled", "Sorted, batches shuffled"),
    ("group_by_length", "HF group_by_length"),
    ("gmt", "GMT"),
    ("bmt", "BMT"),
    ("gmt_textcache", "GMT, text-only cache"),
    ("packing", "Packing"),
    ("peer", "peer odb 0.1.2"),
    ("odb", "ODB"),
    ("odb_nonjoin", "ODB non-join"),
    ("odb_balanced", "ODB + post-balancing"),
    ("odb_balanced_2stage", "ODB + post-bal. + encoder stage"),
]
LABEL = dict(METHODS)
BASELINE = "standard"


def fmt(v, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def md_table(rows: Sequence[Mapping], columns: Sequence[Tuple[str, str]]) -> str:
    head = "| " + " | ".join(h for _, h in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, rule] + body)


def write_csv(path: Path, rows: Sequence[Mapping]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in keys})



# ----------------------------------------------------------------------------- main tables
def speedup(row: Mapping, method: str) -> Optional[float]:
    base = row["results"].get(BASELINE)
    r = row["results"].get(method)
    if base is None or r is None or base.samples_per_s is None or r.samples_per_s is None:
        return None
    return r.samples_per_s / base.samples_per_s


def _cell(row: Mapping, method: str) -> str:
    r = row["results"].get(method)
    if r is None and method == "standard_safe" and row.get("safe_bs") == 1:
        return "= bs=1"
    if r is None:
        return "n/a"
    if r.oom:
        return f"OOM ({r.oom_batches} batches)"
    return f"{r.samples_per_s:.3g} ({speedup(row, method):.2f}×)"


def methods_present(rows: Sequence[Mapping]) -> List[Tuple[str, str]]:
    present = {m for r in rows for m in r["results"]}
    return [(k, h) for k, h in METHODS if k in present]


def main_table(rows: Sequence[Mapping]) -> str:
    """Rows = workload x setting; each method: samples/s (speedup vs Standard bs=1)."""
    methods = methods_present(rows)
    cols = [("workload", "Workload"), ("model", "Model"), ("setting_label", "Setting"),
            ("cv", "Length CV"), ("f_s", "f_s")] + [(k, h) for k, h in methods] + \
        [("paper_odb", "paper ODB ×"), ("ratio", "ours/paper")]
    out = []
    for r in rows:
        d = {k: r[k] for k in ("workload", "model", "setting_label")}
        d["cv"], d["f_s"] = round(r["cv"], 2), round(r["f_s"], 2)
        for k, _ in methods:
            d[k] = _cell(r, k)
        fig = r.get("paper")
        ours = speedup(r, "odb")
        d["paper_odb"] = fig.odb_speedup if fig else _range_text(r["setting"])
        d["ratio"] = (f"{ours / fig.odb_speedup:.2f}"
                      + (" ✓" if paper.within_tolerance(ours, fig.odb_speedup) else " ✗")
                      if fig and ours else "—")
        out.append(d)
    return md_table(out, cols)


def _range_text(setting: str) -> str:
    rng = paper.range_for(setting)
    return f"range {rng[0]}–{rng[1]}" if rng else "—"



def detail_rows(rows: Sequence[Mapping]) -> List[dict]:
    out = []
    for r in rows:
        for k, _ in METHODS:
            res = r["results"].get(k)
            if res is None:
                continue
            out.append({"workload": r["workload"], "model": r["model"], "setting": r["setting"],
                        "method": k, "samples_per_s": res.samples_per_s,
                        "speedup": speedup(r, k), "tokens_per_s": res.tokens_per_s,
                        "padding_ratio": res.padding_ratio, "optimizer_steps": res.optimizer_steps,
                        "micro_steps": res.micro_steps, "max_over_lb": res.max_over_lb,
                        "max_over_mean": res.max_over_mean, "oom_batches": res.oom_batches,
                        "peak_tokens": res.peak_tokens, "idle_slots": res.idle_slots,
                        "time_s": res.time_s, "note": res.note})
    return out


def detail_table(rows: Sequence[Mapping], setting: str = "1n-full", model: str = "8B") -> str:
    sel = [d for d in detail_rows(rows) if d["setting"] == setting and d["model"] == model]
    for d in sel:
        d["method"] = LABEL.get(d["method"], d["method"])
    cols = [("workload", "Workload"), ("method", "Method"), ("samples_per_s", "samples/s"),
            ("speedup", "×"), ("tokens_per_s", "real tok/s"), ("padding_ratio", "padding"),
            ("optimizer_steps", "opt. steps"), ("max_over_lb", "max/LB"), ("oom_batches", "OOM"),
            ("peak_tokens", "peak tok/rank"), ("note", "config")]
    return md_table(sel, cols)
