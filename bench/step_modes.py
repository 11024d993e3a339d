"""Optimizer-step modes side by side: Standard vs ODB `samples` (the same optimizer steps with
the same samples, so the same model) at per-device batch 1 and 2 and gradient accumulation
1, 4 and 16; ODB `groups` (the paper's: budget-filled micro-batches, fewer optimizer steps)
beside them for eval loss.

    python -m bench.step_modes [--quick] [--repeats N] [--resume]

Measured: real LLaMA-Factory runs (the torchrun command `llamafactory-cli train` starts) on 2
CPU ranks (tiny Qwen3-VL, generated demo set, bench.measured's settings), Standard and `samples`
alternating inside every repeat; the throughput is train samples over HF's `train_runtime`
(start-up excluded, the same samples for both). Simulated: the paper-scale workloads through the
step model (bench.simulate), Standard's schedule against `samples` packing of the very same
schedule (bench.methods.odb_samples),
8B on one 8-GPU node.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

from . import methods as M
from .measured import RUNS, STANDARD_RECIPE, train
from .simulate import check_ledger, evaluate, features

SAMPLES_RECIPE = "recipes/tiny/qwen3vl_tiny_odb_samples.yaml"
GROUPS_RECIPE = "recipes/tiny/qwen3vl_tiny_odb.yaml"
CELLS = [(bs, ga) for bs in (1, 2) for ga in (1, 4, 16)]
LEDGERS = {False: RUNS / "step_modes.jsonl", True: RUNS / "step_modes_quick.jsonl"}  # by --quick


def _record(name: str, recipe: str, bs: int, ga: int, repeat: int, mode: str) -> dict:
    metrics = train(name, recipe, per_device_train_batch_size=bs, gradient_accumulation_steps=ga)
    return {"name": name, "mode": mode, "bs": bs, "ga": ga, "repeat": repeat,
            "train_runtime": metrics["train_runtime"], "train_loss": metrics.get("train_loss"),
            "eval_loss": metrics.get("eval_loss"), "optimizer_steps": metrics["optimizer_steps"]}


def measure(repeats: int, cells: List[tuple], resume: bool, quick: bool = False) -> List[dict]:
    """Every (repeat, cell): Standard then `samples`; at batch 1 × accumulation 4 also `groups`.
    A quick run keeps its own ledger, so it never replaces a full run's."""
    ledger = LEDGERS[quick]
    done = {}
    if resume and ledger.exists():
        done = {r["name"]: r for r in map(json.loads, ledger.read_text().splitlines())}
    elif ledger.exists():
        ledger.unlink()
    ledger.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat in range(repeats):
        for bs, ga in cells:
            runs = [("standard", STANDARD_RECIPE), ("samples", SAMPLES_RECIPE)]
            if (bs, ga) == (1, 4):
                runs.append(("groups", GROUPS_RECIPE))
            for mode, recipe in runs:
                name = f"step_{mode}_bs{bs}_ga{ga}_r{repeat}" + ("_quick" if quick else "")
                if name not in done:
                    print(f"[step modes] repeat {repeat + 1}/{repeats}: {mode}, batch {bs} × "
                          f"accumulation {ga}", file=sys.stderr, flush=True)
                    done[name] = _record(name, recipe, bs, ga, repeat, mode)
                    with ledger.open("a") as f:
                        f.write(json.dumps(done[name]) + "\n")
                rows.append(done[name])
    return rows


def _spread(values: List[float], digits: int = 3) -> str:
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}g} ± {sd:.2g}"


def measured_table(rows: List[dict], samples: int) -> List[dict]:
    """One line per cell: samples/s of both modes (mean ± sd over repeats), the per-repeat
    ratio (mean, min, max), optimizer steps and eval loss of both."""
    out = []
    for bs, ga in sorted({(r["bs"], r["ga"]) for r in rows}):
        by = {m: sorted((r for r in rows if (r["bs"], r["ga"], r["mode"]) == (bs, ga, m)),
                        key=lambda r: r["repeat"]) for m in ("standard", "samples")}
        std, odb = by["standard"], by["samples"]
        pairs = [(s, o) for s in std for o in odb if s["repeat"] == o["repeat"]]
        if not pairs:
            continue
        ratios = [s["train_runtime"] / o["train_runtime"] for s, o in pairs]
        out.append({
            "batch": bs, "accumulation": ga, "repeats": len(pairs),
            "Standard samples/s": _spread([samples / s["train_runtime"] for s, _ in pairs]),
            "samples samples/s": _spread([samples / o["train_runtime"] for _, o in pairs]),
            "speedup": statistics.mean(ratios), "min": min(ratios), "max": max(ratios),
            "optimizer steps (Std / samples)": f"{std[0]['optimizer_steps']} / {odb[0]['optimizer_steps']}",
            "eval loss rel. diff": max(abs(o["eval_loss"] - s["eval_loss"]) / s["eval_loss"]
                                       for s, o in pairs)})
    return out


def eval_loss_table(rows: List[dict]) -> List[dict]:
    """Batch 1 × accumulation 4, after the same samples: the three modes' eval loss and steps."""
    out = []
    for mode in ("standard", "samples", "groups"):
        runs = [r for r in rows if (r["bs"], r["ga"], r["mode"]) == (1, 4, mode)]
        if runs:
            out.append({"mode": mode, "optimizer steps": runs[0]["optimizer_steps"],
                        "eval loss": _spread([r["eval_loss"] for r in runs], digits=6), "runs": len(runs),
                        "train runtime s": _spread([r["train_runtime"] for r in runs])})
    return out


def simulated_table(profiles: Dict[str, object], mfu: float, seed: int = 0) -> List[dict]:
    """Paper scale (8B, one node of 8): Standard's schedule vs `samples` packing of the very
    same schedule, for every (batch, accumulation) cell; OOM where the step model says so."""
    from .lab import step_model_for
    m = step_model_for("8B", "1n-full", mfu)
    out = []
    for name, p in profiles.items():
        for bs, ga in CELLS:
            std = M.standard(p, m.world, bs, seed, accumulation=ga)
            odb = M.odb_samples(std, p, p.token_budget)
            fast = M.odb_samples(std, p, p.token_budget, "packed", True, name="odb_samples_pf_global")
            check_ledger(odb, len(p))
            check_ledger(fast, len(p))
            r_std, r_odb = evaluate(features(std, p), p, m), evaluate(features(odb, p), p, m)
            r_fast = evaluate(features(fast, p), p, m)
            assert r_std.optimizer_steps == r_odb.optimizer_steps == r_fast.optimizer_steps, \
                "samples mode changed the steps"
            out.append({"workload": name, "batch": bs, "accumulation": ga,
                        "optimizer steps": r_std.optimizer_steps,
                        "Standard samples/s": r_std.samples_per_s, "samples samples/s": r_odb.samples_per_s,
                        "speedup": (r_odb.samples_per_s / r_std.samples_per_s
                                    if r_std.samples_per_s and r_odb.samples_per_s else None),
                        "padding-free + global samples/s": r_fast.samples_per_s,
                        "its speedup": (r_fast.samples_per_s / r_std.samples_per_s
                                        if r_std.samples_per_s and r_fast.samples_per_s else None),
                        "micro-steps (Std / samples)": f"{r_std.micro_steps} / {r_odb.micro_steps}",
                        "padding (Std / samples)": f"{r_std.padding_ratio:.0%} / {r_odb.padding_ratio:.0%}"})
    return out


def markdown(rows: List[dict]) -> str:
    if not rows:
        return "(no rows)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append("OOM" if v is None and "samples/s" in k else
                         f"{v:.3g}" if isinstance(v, float) else "" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(row: dict) -> str:
    return f"{row['speedup']:.2f}× (batch {row['batch']} × accumulation {row['accumulation']})"


def verdicts(rows: List[dict], measured: List[dict], sim: Optional[List[dict]] = None) -> List[str]:
    """Sentences computed from the runs and tables (raw values, not their formatting)."""
    out = []
    if measured:
        best = max(measured, key=lambda r: r["speedup"])
        worst = min(measured, key=lambda r: r["speedup"])
        span = _cell(best) if best is worst else f"from {_cell(worst)} to {_cell(best)}"
        steps = {(r["bs"], r["ga"], r["repeat"], r["mode"]): r["optimizer_steps"] for r in rows}
        same_steps = all(n == steps.get((bs, ga, rep, "standard"))
                         for (bs, ga, rep, mode), n in steps.items() if mode == "samples")
        out.append(f"`samples` against Standard on this machine: {span}; largest eval-loss "
                   f"difference {max(r['eval loss rel. diff'] for r in measured):.1e} relative, "
                   + ("with the same optimizer steps." if same_steps else "optimizer steps DIFFER."))
    at_1x4 = {m: [r for r in rows if (r["bs"], r["ga"], r["mode"]) == (1, 4, m)] for m in ("samples", "groups")}
    if all(at_1x4.values()):
        g = statistics.mean(r["eval_loss"] for r in at_1x4["groups"])
        s = statistics.mean(r["eval_loss"] for r in at_1x4["samples"])
        out.append(f"`groups` took {at_1x4['groups'][0]['optimizer_steps']} optimizer steps against "
                   f"{at_1x4['samples'][0]['optimizer_steps']} and ended at eval loss {g:.4g} against "
                   f"{s:.4g} ({(g - s) / s:+.1%}).")
    priced = [r for r in sim or [] if r["speedup"] is not None]
    if priced:
        slower = [r for r in priced if r["speedup"] < 1.0]
        worst = min(priced, key=lambda r: r["speedup"])
        best = max(priced, key=lambda r: r["speedup"])
        out.append(f"Simulated: `samples` is slower than Standard in {len(slower)} of {len(priced)} "
                   f"priced cells (worst {worst['workload']}, {_cell(worst)}; it packs into as few "
                   f"micro-batches as the budget allows, which pads more than small fixed batches), "
                   f"best {best['workload']}, {_cell(best)}; Standard runs out of memory in "
                   f"{sum(1 for r in sim if r['Standard samples/s'] is None)} cells where "
                   "`samples` does not.")
        fast = [r["its speedup"] for r in priced if r["its speedup"] is not None]
        if fast:
            out.append(f"Simulated, `samples` with padding-free groups and global grouping (the same steps "
                       f"and samples): {min(fast):.2f}–{max(fast):.2f}× Standard, slower in "
                       f"{sum(1 for x in fast if x < 1.0)} of {len(fast)} priced cells.")
    return out


def section(rows: List[dict], samples: int, sim: Optional[List[dict]], quick: bool) -> str:
    measured, losses = measured_table(rows, samples), eval_loss_table(rows)
    parts = ["## Optimizer-step modes: Standard vs ODB `samples` (same steps, same samples)",
             "Measured: LLaMA-Factory (the torchrun command of `llamafactory-cli train`), 2 CPU ranks, "
             "tiny Qwen3-VL on the generated demo set "
             f"(synthetic data), {samples} training samples per run"
             + (" (quick mode: one cell, one repeat)" if quick else "")
             + "; samples/s = training samples / HF `train_runtime`; speedup = per-repeat ratio of "
               "runtimes (mean, min, max).", markdown(measured),
             "Eval loss after the same samples (batch 1 × accumulation 4):", markdown(losses)]
    parts += verdicts(rows, measured, sim)
    if sim:
        parts += ["Simulated at paper scale (8B, 1 node × 8, the step model of this report): "
                  "Standard's schedule vs `samples` packing of the same schedule, padded and padding-free "
                  "with global grouping.", markdown(sim)]
    return "\n\n".join(parts)


def simulated_section(sim: List[dict]) -> str:
    """The paper-scale part alone (`make bench QUICK=1`: the measured side is
    bench.measured_runs' table, where ODB samples runs beside Standard)."""
    return "\n\n".join(["## Optimizer-step modes at paper scale: Standard vs ODB `samples` (simulated)",
                         "Standard's schedule vs `samples` packing of the same schedule, padded and "
                         "padding-free with global grouping (8B, 1 node × 8, the step model of this report).",
                         markdown(sim)] + verdicts([], [], sim))


def train_samples() -> int:
    """Training rows of a measured run (bench.measured.COMMON: max_samples less val_size)."""
    from .measured import COMMON
    return COMMON["max_samples"] - int(COMMON["max_samples"] * COMMON["val_size"] + 0.999999)


def main(argv=None, profiles: Optional[dict] = None, mfu: Optional[float] = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one cell (batch 1 × accumulation 4), one repeat")
    ap.add_argument("--repeats", type=int, default=None, help="default: 5 (1 with --quick)")
    ap.add_argument("--resume", action="store_true", help="keep runs already in the ledger")
    ap.add_argument("--no-simulation", action="store_true")
    a = ap.parse_args(argv)
    from odb_factory.demo.synthetic_data import write_demo_dataset
    from odb_factory.demo.tiny_model import build_tiny_qwen3vl
    repo = Path(__file__).resolve().parents[1]
    build_tiny_qwen3vl(repo / ".cache" / "tiny_qwen3vl", seed=0)
    write_demo_dataset(repo / ".cache" / "odb_demo_data", seed=0)
    cells = [(1, 4)] if a.quick else CELLS
    rows = measure(a.repeats or (1 if a.quick else 5), cells, a.resume, a.quick)
    sim = None
    if not a.no_simulation:
        if profiles is None:
            from .calibration import calibrate_mfu
            from .lab import Lab
            from .workloads import paper_profiles
            profiles = paper_profiles(6000 if a.quick else 20000, 0)
            mfu = calibrate_mfu(Lab(0), profiles) if mfu is None else mfu
        sim = simulated_table(profiles, mfu)
    text = section(rows, train_samples(), sim, a.quick)
    out = repo / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_modes.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    print(main())
