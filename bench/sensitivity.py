"""How far every simulated speedup moves when the inputs nobody can measure here move.

The pricing inputs (matmul efficiency, fixed per-step overhead, bus bandwidth) take every
combination of their low / nominal / high values (bench.assumptions); the profile inputs (the
length-distribution family, the mean length) regenerate the profiles, one at a time, and each
regenerated profile is priced under every pricing combination too. A method's band is the
lowest and highest speedup over Standard bs=1 seen anywhere on that grid; the one-at-a-time
columns say which input moves it.

Verdict on a paper figure (our plain ODB against the paper's ODB speedup), judged by the same
±15% the report's matches use:
  - "not informative": the band is wider than 15% of the paper's figure, so the inputs alone
    could turn a match into a miss;
  - "matches, robust" / "misses, robust": the whole band is inside / outside ±15%;
  - "straddles": the band is narrow enough but crosses the ±15% edge.
Synthetic profiles (bench.assumptions.SYNTHETIC_WORKLOADS) get a verdict but are not counted.

Methods covered: every schedule bench.lab builds from the profile and world size alone, and the
fixed-batch ones (Standard OOM-safe, Sorted, group_by_length). Post-balanced variants and the
tuned text-only cache are left out (their schedules depend on the step model being varied).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from odb_factory.simulation import step_model as _sm

from . import paper
from .assumptions import BANDWIDTH, FAMILY, MEAN_SCALE, MFU, OVERHEAD, PRICING, is_synthetic, markdown_table
from .lab import SETTINGS, Lab, batch_schedules, common_schedules
from .simulate import evaluate
from .step_model import MODELS, StepModel, build_step_model
from .tables import LABEL, ODB_VARIANTS, fmt, md_table, write_csv
from .workloads import Profile

INPUTS = ("mfu", "overhead", "bandwidth", "family", "mean")
BEST_RATIO = "best_odb_over_best_other"


@dataclasses.dataclass(frozen=True)
class Inputs:
    mfu: float
    overhead: float = 1.0
    bandwidth: float = 1.0
    family: str = "lognormal"
    mean: float = 1.0

    def differs_only_in(self, nominal: "Inputs") -> Optional[str]:
        """The one input in which self differs from `nominal` ("" if none, None if several)."""
        diff = [k for k in INPUTS if getattr(self, k) != getattr(nominal, k)]
        return "" if not diff else (diff[0] if len(diff) == 1 else None)


def price(model: str, setting: str, x: Inputs) -> StepModel:
    """The step model of (model, setting) under the pricing inputs of `x`."""
    _, hw, mode = SETTINGS[setting]
    hw = dataclasses.replace(hw, intra_busbw=hw.intra_busbw * x.bandwidth,
                             inter_busbw=hw.inter_busbw * x.bandwidth)
    m = build_step_model(MODELS[model], hw, mode, mfu=x.mfu)
    k = x.overhead
    return dataclasses.replace(m, c0=m.c0 * k, idle_s=m.idle_s * k,
                               optimizer_s=m.optimizer_s + (k - 1) * _sm.OPTIMIZER_FIXED_S)


def pricing_grid(mfu: float) -> List[Inputs]:
    """Every combination of low / nominal / high of the pricing inputs (3^3 = 27)."""
    levels = [(MFU.low, mfu, MFU.high), (OVERHEAD.low, 1.0, OVERHEAD.high),
              (BANDWIDTH.low, 1.0, BANDWIDTH.high)]
    return [Inputs(a, b, c) for a, b, c in itertools.product(*levels)]


def profile_variants() -> List[Tuple[str, float]]:
    """(family, mean scale): the nominal profile, then each profile input moved alone."""
    return ([(FAMILY.nominal, 1.0)] + [(f, 1.0) for f in (FAMILY.low, FAMILY.high)]
            + [(FAMILY.nominal, s) for s in (MEAN_SCALE.low, MEAN_SCALE.high)])


def _speedups(lab: Lab, p: Profile, model: str, setting: str, m: StepModel,
              bs: int) -> Dict[str, Optional[float]]:
    world = SETTINGS[setting][1].world
    keys = {**common_schedules(lab, p, world), **batch_schedules(lab, p, world, bs)}
    sps = {}
    for name, key in keys.items():
        f = lab.features(key, p)
        if f is not None:
            sps[name] = evaluate(f, p, m).samples_per_s
    base = sps.get("standard")
    out = {k: (v / base if v is not None and base else None) for k, v in sps.items()}
    ours = [v for k, v in sps.items() if k in ODB_VARIANTS and v is not None]
    other = [v for k, v in sps.items() if k not in ODB_VARIANTS and v is not None]
    out[BEST_RATIO] = max(ours) / max(other) if ours and other else None
    return out


def sweep(profiles: Mapping[str, Profile], regenerate: Mapping[str, Callable[..., Profile]],
          rows: Sequence[Tuple[str, str, str]], mfu: float, seed: int = 0,
          nominal_lab: Optional[Lab] = None, paper_rows_only: bool = False,
          log=lambda msg: None) -> List[dict]:
    """One record per (row, method): nominal speedup, band, one-at-a-time bands.

    profiles: the nominal profiles by name; regenerate[name](family=..., mean_scale=...) builds a
    variant (workloads without an entry, e.g. real data, get the pricing inputs only);
    nominal_lab: the report's Lab, whose schedules of the nominal profiles are reused;
    paper_rows_only: vary the profile inputs only on rows with a paper figure (quick mode: the
    regenerated profiles' schedules are most of the cost)."""
    nominal = Inputs(mfu)
    grid = pricing_grid(mfu)
    seen: Dict[Tuple[str, str, str, str], List[Tuple[Inputs, Optional[float]]]] = {}
    for workload in dict.fromkeys(w for w, _, _ in rows):
        for family, mean in profile_variants():
            is_nominal = (family, mean) == (FAMILY.nominal, 1.0)
            if is_nominal:
                p, lab = profiles[workload], nominal_lab or Lab(seed)
            elif workload in regenerate:
                kwargs = {"family": family} if mean == 1.0 else {"mean_scale": mean}
                if not set(kwargs) <= set(inspect.signature(regenerate[workload]).parameters):
                    continue            # a profile without that input (MM-Mix has no mean)
                p, lab = regenerate[workload](**kwargs), Lab(seed)
            else:
                continue
            log(f"sensitivity: {workload}, {family}, mean x{mean}")
            for w, model, setting in rows:
                if w != workload or (not is_nominal and paper_rows_only
                                     and paper.figure_for(w, model, setting) is None):
                    continue
                nominal_m = price(model, setting, nominal)
                bs = max(1, nominal_m.safe_batch(int(p.tokens.max()), int(p.patches.max())))
                for x in grid:
                    x = dataclasses.replace(x, family=family, mean=mean)
                    for method, v in _speedups(lab, p, model, setting, price(model, setting, x), bs).items():
                        seen.setdefault((workload, model, setting, method), []).append((x, v))
    return [_record(key, values, nominal) for key, values in seen.items()]


def _record(key, values: List[Tuple[Inputs, Optional[float]]], nominal: Inputs) -> dict:
    workload, model, setting, method = key
    finite = [v for _, v in values if v is not None]
    rec = {"workload": workload, "model": model, "setting": setting, "synthetic": is_synthetic(workload),
           "method": method, "nominal": next((v for x, v in values if x == nominal), None),
           "low": min(finite) if finite else None, "high": max(finite) if finite else None,
           "combinations": len(values), "oom_combinations": len(values) - len(finite)}
    for name in INPUTS:
        alone = [v for x, v in values if v is not None and x.differs_only_in(nominal) in (name, "")]
        rec[f"{name}_low"], rec[f"{name}_high"] = (min(alone), max(alone)) if len(alone) > 1 else (None, None)
    fig = paper.figure_for(workload, model, setting)
    rec["paper"] = fig.odb_speedup if fig is not None and method == "odb" else None
    rec["verdict"] = verdict(rec["low"], rec["high"], rec["paper"]) if rec["paper"] else None
    return rec


def verdict(low: float, high: float, theirs: float, tolerance: float = paper.TOLERANCE) -> str:
    if high - low > tolerance * theirs:
        return "not informative"
    lo_in, hi_in = paper.within_tolerance(low, theirs), paper.within_tolerance(high, theirs)
    if lo_in and hi_in:
        return "matches, robust"
    if not lo_in and not hi_in and (high < theirs or low > theirs):
        return "misses, robust"
    return "straddles"


def _widest_input(rec: Mapping) -> Optional[str]:
    widths = {k: rec[f"{k}_high"] - rec[f"{k}_low"] for k in INPUTS if rec.get(f"{k}_low") is not None}
    return max(widths, key=widths.get) if widths else None


def _band(rec: Mapping) -> str:
    return f"{fmt(rec['low'])}–{fmt(rec['high'])}" if rec["low"] is not None else "—"


def section(records: Sequence[Mapping], out: Path, paper_rows_only: bool = False) -> str:
    """Writes sensitivity.csv; returns the report section (every sentence computed)."""
    write_csv(out / "sensitivity.csv", records)
    setting_label = {k: v[0] for k, v in SETTINGS.items()}
    figs = [r for r in records if r["paper"]]
    fig_rows = [{"workload": r["workload"] + (" (synthetic)" if r["synthetic"] else ""), "model": r["model"],
                 "setting": setting_label[r["setting"]], "ODB ×": r["nominal"], "band": _band(r),
                 "paper ×": r["paper"], "gap to paper": abs(r["nominal"] - r["paper"]) if r["nominal"] else None,
                 "band width / paper": (r["high"] - r["low"]) / r["paper"], "moved most by": _widest_input(r),
                 "verdict": r["verdict"]} for r in figs]
    counted = [r for r in figs if not r["synthetic"]]
    robust = sum(r["verdict"] == "matches, robust" for r in counted)
    uninformative = [f"{r['workload']} {r['model']} {setting_label[r['setting']]}" for r in counted
                     if r["verdict"] == "not informative"]
    synthetic = [r for r in figs if r["synthetic"]]
    combos = max((r["combinations"] for r in records), default=0)
    lines = [
        "Every simulated speedup over Standard bs=1, recomputed over the uncertain inputs below: all "
        f"{3 ** len(PRICING)} combinations of the pricing inputs, for the nominal profiles and for "
        "each profile input moved alone (up to "
        f"{combos} priced variants per method and row"
        + ("; in this quick run the profile inputs are varied on the paper-figure rows only" if paper_rows_only
           else "") + "). Assumptions and their sources (bench/assumptions.py):",
        "", markdown_table(), "",
        f"### Paper figures (plain ODB), judged by ±{paper.TOLERANCE:.0%}", "",
        md_table(fig_rows, [(k, k) for k in fig_rows[0]]) if fig_rows else "(no paper figure in these rows)", "",
        f"Of the {len(counted)} paper figures on public workloads, {robust} match robustly (the whole band "
        f"within ±{paper.TOLERANCE:.0%})"
        + (f"; not informative: {', '.join(uninformative)}" if uninformative else "")
        + (f". Synthetic, not counted: {', '.join(r['workload'] + ' ' + r['model'] for r in synthetic)} "
           f"({', '.join(r['verdict'] for r in synthetic)})." if synthetic else "."),
        "",
    ]
    best = [r for r in records if r["method"] == BEST_RATIO and r["low"] is not None]
    if best:
        always = [r for r in best if r["low"] >= 0.99]
        worst = min(best, key=lambda r: r["low"])
        lines += [
            "### Does the ranking survive? Fastest ODB variant / fastest other method", "",
            md_table([{"workload": r["workload"] + (" (synthetic)" if r["synthetic"] else ""),
                       "model": r["model"], "setting": setting_label[r["setting"]], "nominal": r["nominal"],
                       "band": _band(r), "moved most by": _widest_input(r)} for r in best],
                     [(k, k) for k in ("workload", "model", "setting", "nominal", "band", "moved most by")]), "",
            f"The fastest ODB variant stays ≥ 0.99× the fastest other method over the whole band in "
            f"{len(always)} of {len(best)} rows; the lowest ratio anywhere is {worst['low']:.3f} "
            f"({worst['workload']}, {worst['model']}, {setting_label[worst['setting']]}).", ""]
    lines.append("Every method's band, with its one-at-a-time columns: `bench/results/sensitivity.csv`"
                 f" ({len(records)} rows; methods: "
                 + ", ".join(sorted({LABEL.get(r['method'], r['method']) for r in records
                                     if r['method'] != BEST_RATIO})) + ").")
    return "\n".join(lines)
