"""The measured layer: every method on the same model, data and samples, repeated, with 95%
confidence intervals and the eval loss after the same samples.

    python -m bench.measured_runs [--quick] [--repeats N] [--samples N]

Real LLaMA-Factory training (`run_exp`, what `llamafactory-cli train` calls) on 2 CPU ranks
(gloo) of the tiny Qwen3-VL on a generated mixed text/image set (synthetic, length CV ≈ 1):
all runs of one invocation go through one torchrun (bench/lf_multi_run.py), so start-up is paid
once; throughput is over HF's `train_runtime`, which leaves start-up out anyway.

Methods, one epoch each over the same training split (10% held out for the eval loss):
  Standard                   per-device batch 1, accumulation 4 (the fixed-batch run)
  Standard at ODB's batch    per-device batch = ODB groups' mean samples per micro-step, accumulation 1
  group_by_length            HF's length-grouped sampler at that batch
  ODB groups                 budget-filled groups, one per optimizer step (the paper's)
  ODB samples                Standard's optimizer steps and samples, packed under the budget
  ODB padding-free           ODB samples with each group one flattened row
  peer package               online-dynamic-batching 0.1.2 through its own LLaMA-Factory adapter
                             (`odb.integrations.llamafactory.enable_odb`), tried once at the end:
                             its figures, or the error it stops with

Order: a calibration run of ODB groups first (not counted: its mean group size sets the matched
batch, and it warms the processes), then repeat after repeat, the methods in a seeded random
order per repeat, so drift hits all alike.
Per run (`measured_runs.csv`): samples, train_s, samples/s, real tokens/s (counted by ODB's
ledgers: ODB groups trains each sample once; the other methods the fixed-batch sampler's epoch,
padded to a multiple of the ranks, which ODB samples reproduces), optimizer steps, eval loss,
and the share of train time inside `training_step` (forward + backward). The step model's form
is fitted to every method's `training_step` calls outside the last repeat and checked, per
method, on that held-back repeat (`step_model_check.csv`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import yaml
from scipy import stats

from odb_factory.llamafactory import launch
from odb_factory.llamafactory.audit_ledger import read_ledger

from .measured import mean_group_size, offline_env, step_records
from .solvers import scaled_nnls
from .tables import fmt, md_table, write_csv

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / ".cache" / "bench_measured_runs"
DATA = REPO / ".cache" / "bench_measured_data"
ACCUMULATION = 4
BUDGET = 1024
STANDARD = "Standard"
METHODS = (STANDARD, "Standard at ODB's batch", "group_by_length", "ODB groups", "ODB samples", "ODB padding-free")
CSV_COLUMNS = ("method", "repeat", "samples", "train_s", "samples_per_s", "tokens_per_s", "optimizer_steps",
               "eval_loss", "compute_share")


def base_config(samples: int) -> dict:
    recipe = yaml.safe_load((REPO / "recipes" / "tiny" / "qwen3vl_tiny_standard.yaml").read_text())
    recipe.update(dataset_dir=str(DATA), model_name_or_path=str(REPO / ".cache" / "tiny_qwen3vl"),
                  max_samples=samples, val_size=0.1, do_eval=True, eval_strategy="no",
                  per_device_eval_batch_size=4, seed=3, learning_rate=1e-3, save_strategy="no",
                  dataloader_num_workers=1, per_device_train_batch_size=1,
                  gradient_accumulation_steps=ACCUMULATION)
    return recipe


def method_config(method: str, base: dict, matched_batch, out: Path) -> dict:
    """One run's config; `matched_batch`: an int, or bench/lf_multi_run.py's placeholder for it."""
    odb = {"odb_enable": True, "odb_token_budget": BUDGET, "odb_buffer_size": 64, "odb_collate_workers": 1,
           "odb_audit_dir": str(out) + "_audit"}
    config = dict(base, output_dir=str(out))
    if method == "Standard at ODB's batch":
        config.update(per_device_train_batch_size=matched_batch, gradient_accumulation_steps=1)
    elif method == "group_by_length":
        config.update(per_device_train_batch_size=matched_batch, gradient_accumulation_steps=1,
                      train_sampling_strategy="group_by_length")
    elif method == "ODB groups":  # padded groups: the paper's method (odb_padding_free's default is auto)
        config.update(odb, odb_step="groups", odb_loss_scaling="exact", gradient_accumulation_steps=1,
                      odb_padding_free=False)
    elif method == "ODB samples":
        config.update(odb, odb_step="samples", odb_padding_free=False)
    elif method == "ODB padding-free":
        config.update(odb, odb_step="samples", odb_padding_free=True)
    elif method != STANDARD:
        raise ValueError(f"unknown method {method!r}")
    return config


def run_all(configs: Sequence[dict], log: Path) -> None:
    """All `configs` in one torchrun of 2 CPU ranks (bench/lf_multi_run.py)."""
    spec = log.with_suffix(".json")
    spec.write_text(json.dumps(list(configs)))
    env = offline_env(TOKENIZERS_PARALLELISM="false", FORCE_TORCHRUN="1", NPROC_PER_NODE="2",
                      PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("ODB_FACTORY_DISABLE", None)
    command = launch.train_command([spec], nproc=2, script=Path(__file__).with_name("lf_multi_run.py"))
    with log.open("w") as fh:
        proc = subprocess.run(command, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"measured runs failed (exit {proc.returncode}); see {log}")


def read_run(method: str, repeat: int, out: Path, samples: int, epoch_tokens: Optional[int]) -> dict:
    results = json.loads((out / "all_results.json").read_text())
    state = json.loads((out / "trainer_state.json").read_text())
    compute = [json.loads(p.read_text())["training_step_s"] for p in sorted(out.glob("compute_rank*.json"))]
    train_s = float(results["train_runtime"])
    return {"method": method, "repeat": repeat, "samples": samples, "train_s": train_s,
            "samples_per_s": samples / train_s,
            "tokens_per_s": epoch_tokens / train_s if epoch_tokens else None,
            "optimizer_steps": state["global_step"], "eval_loss": results.get("eval_loss"),
            "compute_share": max(compute) / train_s if compute else None}


def _epoch_of(method: str) -> str:
    return "join" if method == "ODB groups" else "sampler"


def ledger_tokens(audit: Path) -> tuple:
    """(samples, real input tokens) the ODB ledger counted over the epoch, all ranks."""
    rows = read_ledger(str(audit))
    return sum(len(r["indices"]) for r in rows), sum(int(r["input_tokens"]) for r in rows)


def interval(values: Sequence[float]) -> tuple:
    """Mean and the half-width of its 95% confidence interval (Student's t)."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, float(stats.t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def summary(runs: Sequence[dict]) -> List[dict]:
    """Per method: mean ± 95% CI of samples/s and tokens/s, the ratio to Standard in the same
    repeat (mean ± CI), optimizer steps, eval loss, compute share."""
    base = {r["repeat"]: r["samples_per_s"] for r in runs if r["method"] == STANDARD}
    out = []
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        sps, sps_ci = interval([r["samples_per_s"] for r in mine])
        tps, tps_ci = interval([r["tokens_per_s"] for r in mine])
        ratio, ratio_ci = interval([r["samples_per_s"] / base[r["repeat"]] for r in mine if r["repeat"] in base])
        loss, loss_ci = interval([r["eval_loss"] for r in mine])
        share, _ = interval([r["compute_share"] for r in mine])
        out.append({"method": method, "runs": len(mine), "samples/s": _pm(sps, sps_ci),
                    "tokens/s": _pm(tps, tps_ci), "× Standard": _pm(ratio, ratio_ci),
                    "optimizer steps": "/".join(sorted({str(r["optimizer_steps"]) for r in mine})),
                    "eval loss": _pm(loss, loss_ci, 4), "compute share": share,
                    "_ratio": ratio, "_ratio_ci": ratio_ci, "_sps": sps})
    return out


def _pm(mean: Optional[float], half: Optional[float], digits: int = 3) -> str:
    """`mean ± half` with `digits` significant digits in the mean, the half-width to the same decimals."""
    if mean is None:
        return "—"
    if half is None:
        return fmt(float(mean), digits)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(mean)))) if mean else digits
    return f"{mean:,.{decimals}f} ± {half:,.{decimals}f}"


WORK = ("micro_batches", "tokens", "sum_sq", "images", "patches", "patch_sq")


def step_rows(out: Path) -> List[dict]:
    """A run's `training_step` calls (bench/lf_multi_run.py): per call, each work term's maximum
    over the ranks and the slowest rank's seconds (the ranks meet in every backward)."""
    ranks = [[json.loads(line) for line in f.read_text().splitlines()] for f in sorted(out.glob("steps_rank*.jsonl"))]
    if not ranks or len({len(r) for r in ranks}) != 1:
        raise ValueError(f"{out}: ranks recorded different step counts {[len(r) for r in ranks]}")
    return [{k: max(s[k] for s in calls) for k in WORK + ("time_s",)} for calls in zip(*ranks)]


def step_model_check(steps: Dict[tuple, List[dict]], held_back: int) -> List[dict]:
    """The step model's form (c0 per micro-batch + a·tokens + b·Σlen² + vision terms, all ≥ 0)
    fitted by NNLS on every method's steps of the other repeats, checked per method on repeat
    `held_back`: median |error| per step and the error of the predicted train time."""
    fit = [row for (m, r), rows in steps.items() if r != held_back for row in rows]
    x = np.array([[row[k] for k in WORK] for row in fit], dtype=float)
    coef = scaled_nnls(x, np.array([row["time_s"] for row in fit]))
    out = []
    for method in METHODS:
        rows = steps.get((method, held_back), [])
        if not rows:
            continue
        pred = np.array([[row[k] for k in WORK] for row in rows], dtype=float) @ coef
        meas = np.array([row["time_s"] for row in rows])
        out.append({"method": method, "steps checked": len(rows),
                    "median abs. error per step": float(np.median(np.abs(pred - meas) / meas)),
                    "step time error (Σ)": float(pred.sum() / meas.sum() - 1)})
    return out


def section(runs: Sequence[dict], epochs: Dict[str, tuple], repeats: int, matched_batch: int, quick: bool,
            check: Optional[List[dict]] = None, fitted_steps: int = 0, peer: str = "not tried") -> str:
    rows = summary(runs)
    by = {r["method"]: r for r in rows}
    fastest = max(rows, key=lambda r: r["_sps"])
    same_steps = [m for m in ("ODB samples", "ODB padding-free") if m in by]
    lines = [
        "## Measured: every method on the same samples, repeated (bench.measured_runs)",
        f"Real LLaMA-Factory training on 2 CPU ranks (gloo), tiny Qwen3-VL, generated mixed text/image "
        f"data (synthetic, length CV ≈ 1), one epoch of {epochs['join'][0]} training samples, {repeats} "
        f"repeats per method{' (quick mode)' if quick else ''} (ODB groups trains each sample once; "
        f"the other methods train the fixed-batch sampler's epoch, {epochs['sampler'][0]} samples: it pads to "
        "a multiple of the ranks); ± is the 95% confidence interval of the mean "
        "(Student's t); × Standard is the mean of per-repeat ratios. Standard: batch 1 × accumulation "
        f"{ACCUMULATION}; the matched batch ({matched_batch}) is ODB groups' mean samples per micro-step; "
        f"ODB budget {BUDGET} tokens. Compute share: time inside `training_step` (forward + backward) / "
        "train time, the slowest rank. Every run: `bench/results/measured_runs.csv`.", "",
        md_table(rows, [(k, k) for k in ("method", "runs", "samples/s", "tokens/s", "× Standard",
                                          "optimizer steps", "eval loss", "compute share")]), "",
        f"Fastest here: {fastest['method']} ({fastest['samples/s']} samples/s). "
        + "; ".join(f"{m} keeps Standard's optimizer steps and is {_ratio_text(by[m])} Standard"
                    for m in same_steps) + ".",
        f"Peer package (online-dynamic-batching 0.1.2): {peer}.",
    ]
    if check:
        worst = max(check, key=lambda r: abs(r["step time error (Σ)"]))
        lines += ["", f"Step model out of sample: the form fitted (NNLS) on {fitted_steps} `training_step` calls of "
                  f"every method in repeats 0–{repeats - 2}, checked on repeat {repeats - 1}; per method, the "
                  "median error of a step's predicted time and the error of the summed step time "
                  f"(`step_model_check.csv`). Largest summed error: {worst['method']}, "
                  f"{worst['step time error (Σ)']:+.1%}.", "",
                  md_table(check, [(k, k) for k in check[0]])]
    return "\n".join(lines)


def _ratio_text(row: dict) -> str:
    ratio, half = row["_ratio"], row["_ratio_ci"]
    if half is not None and ratio - half > 1:
        return f"{ratio:.2f}× (CI above 1: faster than)"
    if half is not None and ratio + half < 1:
        return f"{ratio:.2f}× (CI below 1: slower than)"
    return f"{ratio:.2f}× (CI includes 1: not distinguishable from)"


def main(argv=None) -> Dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 repeats of 128 samples")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (3 with --quick)")
    ap.add_argument("--samples", type=int, default=None,
                    help="samples of the generated set (10%% held out): default 10,000, so that the fastest "
                         "method trains for at least a minute on this machine (128 with --quick)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    a = ap.parse_args(argv)
    repeats = a.repeats or (3 if a.quick else 5)
    total = a.samples or (128 if a.quick else 10000)
    from odb_factory.demo.synthetic_data import write_demo_dataset
    from odb_factory.demo.tiny_model import build_tiny_qwen3vl
    build_tiny_qwen3vl(REPO / ".cache" / "tiny_qwen3vl", seed=0)
    write_demo_dataset(DATA, num_samples=total, seed=0)
    shutil.rmtree(RUNS, ignore_errors=True)    # ledgers append: no earlier invocation's rows
    RUNS.mkdir(parents=True)
    base = base_config(total)

    def out_dir(method: str, repeat: int) -> Path:
        return RUNS / f"{method.replace(' ', '_').replace(chr(39), '')}_{repeat}"

    # Calibration, not counted: ODB groups' mean group size is the matched batch, its ledger counts
    # the epoch's samples and real tokens, and it warms the processes (a first run pays lazy
    # initialisation).
    calibration = method_config("ODB groups", base, 1, RUNS / "calibration")
    matched_batch = {"mean_group_size_of": calibration["odb_audit_dir"]}
    order, plan = random.Random(0), []
    for repeat in range(repeats):
        methods = list(METHODS)
        order.shuffle(methods)
        plan += [(m, repeat) for m in methods]
    peer = dict(method_config(STANDARD, base, matched_batch, RUNS / "peer"), gradient_accumulation_steps=1,
                peer_integration=True, peer_token_budget=BUDGET)
    print(f"[measured_runs] a calibration run, {len(plan)} runs and the peer package's attempt, in one torchrun",
          file=sys.stderr, flush=True)
    run_all([calibration] + [method_config(m, base, matched_batch, out_dir(m, r)) for m, r in plan] + [peer],
            RUNS / "runs.log")
    matched = mean_group_size(Path(calibration["odb_audit_dir"]))
    # What each run trained: ODB groups (join) each sample once; every other method the fixed-batch
    # sampler's epoch, which pads to a multiple of the world size (a sample or so twice) and which
    # ODB samples reproduces step for step, so its ledger counts it.
    epochs = {"join": ledger_tokens(Path(calibration["odb_audit_dir"])),
              "sampler": ledger_tokens(Path(str(out_dir("ODB samples", 0)) + "_audit"))}
    runs = [read_run(m, r, out_dir(m, r), *epochs[_epoch_of(m)]) for m, r in plan]
    for m, r in plan:     # every ODB run's ledger agrees with its family's
        audit = Path(str(out_dir(m, r)) + "_audit")
        if audit.exists() and ledger_tokens(audit) != epochs[_epoch_of(m)]:
            raise AssertionError(f"{m} repeat {r}: ledger {ledger_tokens(audit)} != {epochs[_epoch_of(m)]}")
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(a.out / "measured_runs.csv", [{k: run[k] for k in CSV_COLUMNS} for run in runs])
    records = [rec for m, r in plan if m == "ODB groups" for rec in step_records(str(out_dir(m, r)) + "_audit")]
    steps = {(m, r): step_rows(out_dir(m, r)) for m, r in plan}
    check = step_model_check(steps, held_back=repeats - 1) if repeats > 1 else None
    if check:
        write_csv(a.out / "step_model_check.csv", check)
    fitted = sum(len(rows) for (m, r), rows in steps.items() if r != repeats - 1)
    error = RUNS / "peer" / "error.txt"
    peer_text = (f"tried through its own LLaMA-Factory adapter (`odb.integrations.llamafactory.enable_odb` on "
                 f"LLaMA-Factory's trainer and its train DataLoader, batch 1, budget {BUDGET}); it stops with "
                 f"`{error.read_text().strip()}`" if error.exists() else
                 "one run through its own LLaMA-Factory adapter: " + ", ".join(
                     f"{k} {fmt(v)}" for k, v in read_run("peer", 0, RUNS / "peer", *epochs["join"]).items()
                     if k in ("samples_per_s", "optimizer_steps", "eval_loss")))
    text = section(runs, epochs, repeats, matched, a.quick, check, fitted, peer_text)
    return {"runs": runs, "records": records, "section": text, "matched_batch": matched}


if __name__ == "__main__":
    print(main()["section"])
