"""`make bench`: the paper-scale simulation layer, the engine benchmark, the measured layer,
and the report.

    python -m bench.run [--quick 0|1] [--samples N] [--measured rows.csv] [--skip-engine]

Writes bench/results/: report.md, CSVs and PNG plots; prints the main table. Every method's
batches come from its real code path (bench.methods); a calibrated step-time model
(bench.step_model) turns them into simulated wall-clock time (bench.simulate). This module
only runs the steps in order: bench.lab builds the rows, bench.calibration fits the MFU,
bench.ablations sweeps, bench.sensitivity bands every speedup over the uncertain inputs,
bench.paper_comparison words the comparison, bench.report writes.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Optional

from . import ablations, sensitivity
from . import paper_comparison as cmp
from .calibration import calibrate_mfu
from .demo_workload import DEMO_DIR, demo_profile
from .lab import SETTINGS, Lab, evaluate_row
from .measured_report import add_measured_rows, read_measured_rows, write_measured_rows
from .paper_comparison import paper_side_by_side
from .report import BenchResults, is_headline, write_report
from .tables import main_table
from .workloads import PAPER_WORKLOADS, paper_profiles

RESULTS = Path(__file__).resolve().parent / "results"
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def engine_section(quick: bool) -> str:
    log("engine benchmark (bench.engine)")
    from . import engine
    try:
        return engine.main(["--quick"] if quick else [])
    except Exception as exc:  # the engine measures the live loader; report, don't abort
        log(f"engine benchmark failed: {type(exc).__name__}: {exc}")
        return (f"The engine benchmark failed in this run ({type(exc).__name__}: {exc}); "
                "run `python -m bench.engine` alone to see the traceback.")


def measured_layer(quick: bool, out: Path) -> str:
    """Real LLaMA-Factory runs on this machine: every method on the same samples, repeated
    (bench.measured_runs), whose ODB steps are the rows the step model is fitted to; start-up
    figures (bench.startup) in full mode."""
    from . import measured_runs, startup
    log("measured layer: every method, LLaMA-Factory on 2 CPU ranks (tiny Qwen3-VL, generated data)")
    res = measured_runs.main((["--quick"] if quick else []) + ["--out", str(out)])
    write_measured_rows(res["records"], out / "measured_rows.csv")
    text = res["section"]
    if not quick:
        log("measured layer: start-up figures")
        start = startup.main([])
        text += "\n\nStart-up (bench.startup): " + ", ".join(f"{k} = {v:.3f}" for k, v in start.items()) + "."
    return text


def run(quick: bool, samples: Optional[int] = None, seed: int = 0, out: Path = RESULTS,
        measured: Optional[Path] = None, skip_engine: bool = False,
        mfu: Optional[float] = None, skip_measured: bool = False) -> str:
    n = samples or (6000 if quick else 40000)
    out.mkdir(parents=True, exist_ok=True)
    log(f"profiles: {n} samples each ({'quick' if quick else 'full'} mode)")
    profiles = paper_profiles(n, seed)
    demo = demo_profile(n, seed)
    if demo is not None:
        profiles[demo.name] = demo
    else:
        log(f"demo data not found at {DEMO_DIR}: the real-demo row is skipped")
    paper_profs = {k: v for k, v in profiles.items() if k in PAPER_WORKLOADS}
    lab = Lab(seed)
    if mfu is None:
        log("calibrating the matmul efficiency on the paper's Standard samples/s")
        mfu = calibrate_mfu(lab, profiles)
    log(f"MFU = {mfu:.3f}")
    rows = []
    combos = [(w, model, setting) for w in profiles for model in ("8B", "2B") for setting in SETTINGS
              if not (w == "LF demo (real)" and setting != "1n-full")]
    for i, (w, model, setting) in enumerate(combos, 1):
        log(f"[{i}/{len(combos)}] {w} · {model} · {setting}")
        row = evaluate_row(lab, profiles[w], model, setting, mfu)
        cmp.add_paper_notes(lab, row, profiles[w])
        rows.append(row)
    cmp.add_other_model_size_notes(rows)
    log("sensitivity: every speedup over the uncertain inputs (bench.sensitivity)")
    regenerate = {name: functools.partial(make, n, seed) for name, make in PAPER_WORKLOADS.items()}
    records = sensitivity.sweep(profiles, regenerate, [(r["workload"], r["model"], r["setting"]) for r in rows],
                                mfu, seed, nominal_lab=lab, paper_rows_only=quick, log=log)
    sensitivity_md = sensitivity.section(records, out, paper_rows_only=quick)
    log("ablation: L_max sweep")
    lmax = ablations.ablation_lmax(lab, paper_profs, mfu)
    log("ablation: window B")
    buffer_rows = ablations.ablation_buffer(lab, paper_profs, mfu)
    cmp.add_window_notes(rows, buffer_rows)
    log("ablation: outstanding depth D")
    depth = ablations.ablation_depth(lab, paper_profs, mfu)
    log("sweeps: speedup vs CV and vs f_s")
    sweep_n = max(2000, n // 2)
    cv_rows = ablations.sweep_cv(lab, sweep_n, mfu)
    fs_rows = ablations.sweep_short_fraction(lab, sweep_n, mfu)
    engine_md = "" if skip_engine else engine_section(quick)
    measured_md = ""
    cpu_md = ""
    if not skip_measured and measured is None:
        cpu_md = measured_layer(quick, out)
    # The measured layer runs Standard and both step modes at batch 1 x accumulation 4 on the
    # same samples; the measured grid over batch and accumulation (65 launches, ~45 min here)
    # is `python -m bench.step_modes` on its own. Both modes price the grid at paper scale.
    from . import step_modes
    log("optimizer-step modes at paper scale (simulated)")
    cpu_md += "\n\n" + step_modes.simulated_section(step_modes.simulated_table(paper_profs, mfu))
    measured = measured or (out / "measured_rows.csv")
    if measured.exists():
        log(f"measured rows: {measured}")
        measured_md = cpu_md + "\n\n" + add_measured_rows(read_measured_rows(measured), out)
    log("encoder stages on an omni profile (bench.audio_stage)")
    from . import audio_stage
    omni_md = audio_stage.omni_section(quick, out)
    log("writing report")
    results = BenchResults(rows, profiles, lmax, buffer_rows, depth, cv_rows, fs_rows,
                           engine_md, measured_md, mfu, n, quick, omni_md, sensitivity_md)
    text = write_report(out, results)
    print(main_table(results.headline + [r for r in rows if r.get("paper") and not is_headline(r)]))
    print()
    print(paper_side_by_side(rows))
    log(f"done: {out / 'report.md'}")
    return text


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", type=int, choices=(0, 1), default=0,
                    help="1: 6,000 samples per profile (a few minutes); 0: 40,000")
    ap.add_argument("--samples", type=int, default=None, help="samples per profile (overrides --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--measured", type=Path, default=None, help="CSV of measured micro-batch rows")
    ap.add_argument("--mfu", type=float, default=None, help="skip calibration, use this MFU")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-measured", action="store_true", help="no llamafactory-cli runs on this machine")
    a = ap.parse_args(argv)
    return run(bool(a.quick), a.samples, a.seed, a.out, a.measured, a.skip_engine, a.mfu, a.skip_measured)


if __name__ == "__main__":
    main()
