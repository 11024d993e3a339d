"""Markdown and CSV tables of the benchmark, in the paper's layout.

Pure formatting: every number comes from bench.simulate through bench.lab.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

from . import paper
from .assumptions import is_synthetic

METHODS: List[Tuple[str, str]] = [
    ("standard", "Standard bs=1"),
    ("standard_safe", "Standard OOM-safe bs"),
    ("standard_matched", "Standard tok/step matched"),
    ("sorted", "Sorted"),
    ("sorted_shuffled", "Sorted, batches shuffled"),
    ("group_by_length", "HF group_by_length"),
    ("gmt", "GMT"),
    ("gmt_ordered", "GMT, dealt in order"),
    ("bmt", "BMT"),
    ("bmt_ordered", "BMT, dealt in order"),
    ("gmt_textcache", "GMT, text-only cache"),
    ("packing", "Packing"),
    ("packing_ordered", "Packing, dealt in order"),
    ("peer", "peer odb 0.1.2"),
    ("verl", "verl dynamic bsz"),
    ("verl_windows", "verl dynamic bsz, sorted windows"),
    ("window_pack", "window packer + KK"),
    ("epoch_pack", "epoch packer (length cache) + KK"),
    ("epoch_pack_2stage", "epoch packer + KK + encoder stage"),
    ("odb", "ODB"),
    ("odb_nonjoin", "ODB non-join"),
    ("odb_balanced", "ODB + post-balancing"),
    ("odb_balanced_2stage", "ODB + post-bal. + encoder stage"),
    ("odb_global", "ODB global grouping"),
    ("odb_global_balanced", "ODB global grouping + post-bal."),
    ("odb_global_balanced_2stage", "ODB global grouping + post-bal. + encoder stage"),
    ("odb_pf", "ODB padding-free"),
    ("odb_pf_global", "ODB padding-free + global grouping"),
    ("odb_pf_balanced", "ODB padding-free + post-bal."),
    ("odb_pf_balanced_2stage", "ODB padding-free + post-bal. + encoder stage"),
    ("odb_pf_global_balanced", "ODB padding-free + global grouping + post-bal."),
    ("odb_pf_global_balanced_2stage", "ODB padding-free + global grouping + post-bal. + encoder stage"),
    ("limit", "limit (padding-free, perfectly balanced)"),
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
        synthetic = is_synthetic(r["workload"])
        if synthetic:
            d["workload"] += " (synthetic)"
        d["cv"], d["f_s"] = round(r["cv"], 2), round(r["f_s"], 2)
        for k, _ in methods:
            d[k] = _cell(r, k)
        fig = r.get("paper")
        ours = speedup(r, "odb")
        d["paper_odb"] = fig.odb_speedup if fig else _range_text(r["setting"])
        d["ratio"] = (f"{ours / fig.odb_speedup:.2f}"
                      + (" (not counted)" if synthetic else
                         " ✓" if paper.within_tolerance(ours, fig.odb_speedup) else " ✗")
                      if fig and ours else "—")
        out.append(d)
    return md_table(out, cols)


ODB_VARIANTS = ("odb", "odb_nonjoin", "odb_balanced", "odb_balanced_2stage", "odb_global", "odb_global_balanced",
                "odb_global_balanced_2stage", "odb_pf", "odb_pf_global", "odb_pf_balanced", "odb_pf_balanced_2stage",
                "odb_pf_global_balanced", "odb_pf_global_balanced_2stage")
NOT_COMPARED = ("limit",)  # a bound, not a method


def _fastest(results: Mapping, names) -> Tuple[Optional[str], Optional[float]]:
    best = [(r.samples_per_s, k) for k, r in results.items() if k in names and r.samples_per_s is not None]
    return (max(best)[1], max(best)[0]) if best else (None, None)


def standing_rows(rows: Sequence[Mapping]) -> List[dict]:
    """Per row: the fastest ODB variant against the fastest other method (any, OOM excluded),
    the padded variants' least padding, max/LB of the balanced variants, and padding-free ODB
    with global grouping against the limit."""
    out = []
    for r in rows:
        res = r["results"]
        ours, ours_sps = _fastest(res, ODB_VARIANTS)
        other, other_sps = _fastest(res, [k for k in res if k not in ODB_VARIANTS + NOT_COMPARED])
        padded = [res[k] for k in ("odb", "odb_balanced", "odb_global", "odb_global_balanced") if k in res]
        balanced_global = [k for k in ("odb_global_balanced", "odb_global_balanced_2stage") if k in res]
        pf = res.get("odb_pf_global")
        limit = res.get("limit")
        out.append({
            "workload": r["workload"], "model": r["model"], "setting": r["setting_label"],
            "best ODB": LABEL.get(ours, ours), "best other": LABEL.get(other, other),
            "best ODB / best other": ours_sps / other_sps if ours and other else None,
            "padded ODB: padding": min(x.padding_ratio for x in padded) if padded else None,
            "max/LB: ODB post-bal.": res["odb_balanced"].max_over_lb if "odb_balanced" in res else None,
            "max/LB: ODB global (best post-balanced)": (
                f"{res['odb_global'].max_over_lb:.3g} ({min(res[k].max_over_lb for k in balanced_global):.3g})"
                if balanced_global else None),
            "max/LB: padding-free global": pf.max_over_lb if pf else None,
            "padding-free / limit": (pf.samples_per_s / limit.samples_per_s
                                     if pf and limit and pf.samples_per_s and limit.samples_per_s else None)})
    return out


# Methods that read every sample's length of the epoch before the first step (a global sort, a
# whole-epoch cut or pack). The others see what ODB sees: a window of samples at a time.
EPOCH_CACHE = ("sorted", "sorted_shuffled", "group_by_length", "gmt", "gmt_ordered", "bmt", "bmt_ordered",
               "gmt_textcache", "packing", "packing_ordered", "epoch_pack", "epoch_pack_2stage")


def peer_rows(rows: Sequence[Mapping], backend: str) -> List[dict]:
    """Per row, under one attention backend: the fastest ODB variant against the fastest method
    that sees a window at a time as ODB does, and against the fastest with the epoch's length
    cache; the fastest ODB and the fastest other method as fractions of the independent lower
    bounds (bench.peers.lower_bound); ODB's micro-steps beside the fewest that L_max allows."""
    out = []
    for r in rows:
        res = r["results_by_backend"][backend]
        others = [k for k in res if k not in ODB_VARIANTS + NOT_COMPARED]
        ours, ours_sps = _fastest(res, ODB_VARIANTS)
        window, window_sps = _fastest(res, [k for k in others if k not in EPOCH_CACHE])
        cache, cache_sps = _fastest(res, [k for k in others if k in EPOCH_CACHE])
        _, other_sps = _fastest(res, others)
        bounds = r["bounds"]
        out.append({
            "workload": r["workload"], "model": r["model"], "setting": r["setting_label"],
            "best ODB": LABEL.get(ours, ours),
            "best at ODB's information": LABEL.get(window, window),
            "ODB / it": ours_sps / window_sps if ours and window else None,
            "best with the epoch cache": LABEL.get(cache, cache),
            "ODB / it ": ours_sps / cache_sps if ours and cache else None,
            "ODB / bound (L_max)": ours_sps / bounds["L_max"].samples_per_s if ours else None,
            "ODB / bound (memory cap)": ours_sps / bounds["memory cap"].samples_per_s if ours else None,
            "best other / bound (L_max)": other_sps / bounds["L_max"].samples_per_s if other_sps else None,
            "ODB micro-steps (fewest at L_max)": (f"{res[ours].micro_steps} ({bounds['L_max'].micro_steps})"
                                                  if ours else None),
            "unpriced exchange ≤": _percent(_unpriced_share(r, ours, res))})
    return out


def _percent(share: Optional[float]) -> Optional[str]:
    return None if share is None else f"{share:.2%}"


def _unpriced_share(row: Mapping, method: Optional[str], res: Mapping) -> Optional[float]:
    """The share of `method`'s time its unpriced exchanges could add at most (every sample
    moved once, nothing overlapped; bench.peers.exchange_seconds): samples for global grouping
    and post-balancing, embeddings too for the encoder stage; 0 for a variant that moves none."""
    if method is None or "exchange_s" not in row:
        return None
    seconds = 0.0
    if "global" in method or "balanced" in method:
        seconds += row["exchange_s"]["samples"]
    if method.endswith("2stage"):
        seconds += row["exchange_s"]["embeddings"]
    return seconds / res[method].time_s


def peer_table(rows: Sequence[Mapping], backend: str) -> str:
    lines = peer_rows(rows, backend)
    return md_table(lines, [(k, k.strip()) for k in lines[0]]) if lines else "(no rows)"


def peer_summary(rows: Sequence[Mapping], backend: str) -> str:
    """Counts and extremes computed from `peer_rows`, for the report's text."""
    lines = peer_rows(rows, backend)
    if not lines:
        return ""

    def span(key: str, floor: float) -> str:
        vals = [x[key] for x in lines if x[key] is not None]
        if not vals:
            return "—"
        return (f"{min(vals):.3f}–{max(vals):.3f}× (≥ {floor}× in {sum(v >= floor for v in vals)} of "
                f"{len(vals)} rows)")

    moved = [_unpriced_share(r, _fastest(r["results_by_backend"][backend], ODB_VARIANTS)[0],
                             r["results_by_backend"][backend]) for r in rows]
    moved = [x for x in moved if x]
    text = (f"Fastest ODB variant / fastest method at ODB's information: {span('ODB / it', 0.99)}; "
            f"/ fastest method with the epoch's length cache: {span('ODB / it ', 0.98)}; / the lower bound at "
            f"L_max: {span('ODB / bound (L_max)', 0.98)}; / the bound at the memory cap: "
            f"{span('ODB / bound (memory cap)', 0.98)}. The fastest other method reaches "
            f"{span('best other / bound (L_max)', 0.98)} of the L_max bound.")
    if moved:
        text += (f" The exchanges the pricing leaves out could slow the fastest ODB variant by at most "
                 f"{min(moved):.1%}–{max(moved):.1%} of its time (every sample moved once, nothing overlapped).")
    behind = [x for x in lines if (x["ODB / it"] or 2) < 1.0 or (x["ODB / it "] or 2) < 1.0]
    if behind:
        text += " Faster than ODB: " + "; ".join(
            f"{x['workload']} {x['model']} {x['setting']}: "
            + ", ".join(f"{name} ({ratio:.3f}×)" for name, ratio in
                        ((x["best at ODB's information"], x["ODB / it"]),
                         (x["best with the epoch cache"], x["ODB / it "])) if ratio is not None and ratio < 1.0)
            for x in behind) + "."
    return text


def variant_rows(rows: Sequence[Mapping]) -> List[dict]:
    """Per ODB variant: its samples/s over the fastest other method of each row it runs in
    (lowest, highest, rows at ≥ 0.99×)."""
    out = []
    for variant in ODB_VARIANTS:
        ratios = []
        for r in rows:
            res = r["results"]
            _, other_sps = _fastest(res, [k for k in res if k not in ODB_VARIANTS + NOT_COMPARED])
            mine = res.get(variant)
            if mine is not None and mine.samples_per_s is not None and other_sps:
                ratios.append(mine.samples_per_s / other_sps)
        if ratios:
            out.append({"ODB variant": LABEL[variant], "lowest": min(ratios), "highest": max(ratios),
                        "rows ≥ 0.99×": f"{sum(x >= 0.99 for x in ratios)} / {len(ratios)}"})
    return out


def standing_table(rows: Sequence[Mapping]) -> str:
    lines = standing_rows(rows)
    return md_table(lines, [(k, k) for k in lines[0]]) if lines else "(no rows)"


def standing_summary(rows: Sequence[Mapping]) -> str:
    """Counts and extremes computed from `standing_rows`, for the report's text."""
    lines = [x for x in standing_rows(rows) if x["best ODB / best other"] is not None]
    if not lines:
        return ""
    worst = min(lines, key=lambda x: x["best ODB / best other"])
    behind = [x for x in lines if x["best ODB / best other"] < 0.99]
    pf = [x["padding-free / limit"] for x in lines if x["padding-free / limit"] is not None]
    text = (f"The fastest ODB variant is ≥ 0.99× the fastest other method in {len(lines) - len(behind)} of "
            f"{len(lines)} rows; the lowest ratio is {worst['best ODB / best other']:.3f}× "
            f"({worst['workload']}, {worst['model']}, {worst['setting']}: {worst['best other']}).")
    if behind:
        text += " Behind in: " + "; ".join(
            f"{x['workload']} {x['model']} {x['setting']} ({x['best ODB / best other']:.3f}× {x['best other']})"
            for x in behind) + "."
    if pf:
        text += f" Padding-free ODB with global grouping reaches {min(pf):.3f}–{max(pf):.3f}× the limit."
    return text


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
