"""The measured layer of `make bench`: real LLaMA-Factory runs (the torchrun command
`llamafactory-cli train` starts) on 2 CPU ranks with the tiny Qwen3-VL on the generated demo set
(length CV ~1.0), side by side in one process.

* emitted samples/s, ODB vs Standard (batch 1 per device, as the paper's Standard), over
  repeated runs: mean and spread of the ratio;
* ODB with post-balancing on vs off;
* per-step records (padded tokens, attention cost, vision patches of the slowest rank; wall
  time) from ODB's audit ledgers, to fit and check the step-time model (predicted vs measured);
* validation loss after the same samples for Standard, Sorted (group-by-length) and ODB
  (reported, not asserted), and for Standard with ODB's mean samples per micro-step as its
  batch: ODB takes far fewer optimizer steps at the same learning rate, and this run tells
  that effect apart from the grouping itself.

    python -m bench.measured [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np

from odb_factory.llamafactory import launch
from odb_factory.llamafactory.audit_ledger import read_ledger, read_rank_ledgers

from .solvers import scaled_nnls

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / ".cache" / "bench_runs"
ODB_RECIPE = "recipes/tiny/qwen3vl_tiny_odb.yaml"
STANDARD_RECIPE = "recipes/tiny/qwen3vl_tiny_standard.yaml"
COMMON = {"max_samples": 256, "val_size": 0.1, "do_eval": True,
          "per_device_eval_batch_size": 4, "seed": 3}


LLAMAFACTORY_CLI = Path(sys.executable).parent / "llamafactory-cli"


def offline_env(**extra: str) -> Dict[str, str]:
    """This environment with the hubs offline (nothing is reachable from the bench machines)
    and this interpreter's scripts first on PATH (llamafactory-cli starts torchrun from it)."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **extra)


def _env() -> Dict[str, str]:
    """Two CPU ranks under torchrun, ODB's hook on."""
    env = offline_env(TOKENIZERS_PARALLELISM="false", FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    env.pop("ODB_FACTORY_DISABLE", None)
    return env


def train(name: str, recipe: str, **overrides) -> Dict[str, float]:
    """One 2-rank run; returns its train/eval metrics and where its ledger is."""
    out = RUNS / name
    keys = {**COMMON, **overrides, "output_dir": str(out)}
    if "odb" in recipe:
        keys["odb_audit_dir"] = str(RUNS / f"{name}_audit")
        for old in (RUNS / f"{name}_audit").glob("*.jsonl"):
            old.unlink()
    args = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in keys.items()]
    log = RUNS / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        # the torchrun command `llamafactory-cli train` starts (odb_factory.llamafactory.launch):
        # the CLI's own process adds only start-up time, which train_runtime leaves out anyway
        proc = subprocess.run(launch.train_command([recipe, *args], nproc=2),
                              cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed; see {log}")
    metrics = json.loads((out / "all_results.json").read_text())
    metrics["audit"] = str(RUNS / f"{name}_audit")
    metrics["optimizer_steps"] = json.loads((out / "trainer_state.json").read_text())["global_step"]
    return metrics


FEATURES = ("padded_tokens", "attention_cost", "vision_patches")


def step_records(audit_dir: str) -> List[dict]:
    """Per optimizer step: the work of the slowest rank and the wall time since the last step.

    Ranks synchronise at every step, so a step lasts as long as its busiest rank: each
    feature is the maximum over the ranks' ledgers (an upper-bound proxy when different
    ranks are busiest in different features). The wall time is rank 0's; the first step
    also carries warm-up and is left out."""
    ledgers = read_rank_ledgers(audit_dir)
    if len({len(rows) for rows in ledgers}) != 1:
        raise ValueError(f"{audit_dir}: ranks logged different step counts "
                         f"{[len(rows) for rows in ledgers]}")
    out = []
    for i in range(1, len(ledgers[0])):
        steps = [rows[i] for rows in ledgers]
        record = {f: max(float(s.get(f, 0.0)) for s in steps) for f in FEATURES}
        record["samples"] = sum(len(s["indices"]) for s in steps)
        record["seconds"] = ledgers[0][i]["wall_time"] - ledgers[0][i - 1]["wall_time"]
        out.append(record)
    return out


def mean_group_size(audit_dir: Path) -> int:
    """ODB's mean samples per rank per micro-step (rounded, at least 1)."""
    rows = read_ledger(str(audit_dir))
    busy = sum(r["micro_steps"] - r["idle_micro_steps"] for r in rows)
    return max(1, round(sum(len(r["indices"]) for r in rows) / max(1, busy)))


def fit_step_time(records: List[dict]) -> Dict[str, float]:
    """Non-negative least squares of seconds ~ c0 + a*padded_tokens + b*attention +
    v*vision_patches, fitted on even steps and checked on odd ones (predicted vs measured)."""
    x = np.array([[1.0] + [r[f] for f in FEATURES] for r in records])
    y = np.array([r["seconds"] for r in records])
    train, test = slice(0, None, 2), slice(1, None, 2)
    coef = scaled_nnls(x[train], y[train])
    pred = x[test] @ coef
    err = np.abs(pred - y[test]) / np.maximum(y[test], 1e-9)
    return {"c0": coef[0], "a": coef[1], "b": coef[2], "v": coef[3], "steps_fitted": int(len(y[train])),
            "steps_checked": int(len(y[test])), "median_abs_pct_error": float(100 * np.median(err)),
            "mean_abs_pct_error": float(100 * np.mean(err))}


def main(argv=None) -> Dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    from odb_factory.demo.synthetic_data import write_demo_dataset
    from odb_factory.demo.tiny_model import build_tiny_qwen3vl
    build_tiny_qwen3vl(REPO / ".cache" / "tiny_qwen3vl", seed=0)
    stats = write_demo_dataset(REPO / ".cache" / "odb_demo_data", seed=0)
    repeats = 2 if args.quick else 3
    results: Dict[str, object] = {"length_cv": stats["length_cv"], "repeats": repeats}
    ratios, runs = [], []
    for r in range(repeats):
        print(f"[measured] repeat {r + 1}/{repeats}: Standard and ODB, 2 CPU ranks", file=sys.stderr, flush=True)
        std = train(f"standard_{r}", STANDARD_RECIPE)
        odb = train(f"odb_{r}", ODB_RECIPE)
        ratios.append(odb["train_samples_per_second"] / std["train_samples_per_second"])
        runs.append({"repeat": r, "standard_samples_per_s": std["train_samples_per_second"],
                     "odb_samples_per_s": odb["train_samples_per_second"], "ratio": ratios[-1],
                     "standard_eval_loss": std.get("eval_loss"), "odb_eval_loss": odb.get("eval_loss"),
                     "standard_steps": std["optimizer_steps"], "odb_steps": odb["optimizer_steps"]})
    results["runs"] = runs
    results["ratio_mean"] = statistics.mean(ratios)
    results["ratio_min"], results["ratio_max"] = min(ratios), max(ratios)
    records = [rec for r in range(repeats) for rec in step_records(RUNS / f"odb_{r}_audit")]
    if not args.quick:
        for budget in (512, 2048):
            print(f"[measured] ODB token budget {budget}", file=sys.stderr, flush=True)
            train(f"odb_budget{budget}", ODB_RECIPE, odb_token_budget=budget)
            records += step_records(RUNS / f"odb_budget{budget}_audit")
        print("[measured] ODB with post-balancing; Sorted (group-by-length)", file=sys.stderr, flush=True)
        balanced = train("odb_balance", ODB_RECIPE, odb_balance=True)
        results["balance_samples_per_s"] = balanced["train_samples_per_second"]
        results["balance_ratio_vs_odb"] = balanced["train_samples_per_second"] / runs[0]["odb_samples_per_s"]
        sorted_run = train("sorted", STANDARD_RECIPE, train_sampling_strategy="group_by_length",
                           per_device_train_batch_size=4)
        results["sorted_samples_per_s"] = sorted_run["train_samples_per_second"]
        results["sorted_eval_loss"] = sorted_run.get("eval_loss")
        batch = mean_group_size(RUNS / "odb_0_audit")
        print(f"[measured] Standard with ODB's mean group size as its batch ({batch})", file=sys.stderr, flush=True)
        matched = train("standard_matched", STANDARD_RECIPE, per_device_train_batch_size=batch)
        results["matched_batch"] = batch
        results["matched_samples_per_s"] = matched["train_samples_per_second"]
        results["matched_eval_loss"] = matched.get("eval_loss")
        results["matched_steps"] = matched["optimizer_steps"]
    results["records"] = records
    results["step_model"] = fit_step_time(records)
    return results


if __name__ == "__main__":
    print(json.dumps({k: v for k, v in main().items() if k != "records"}, indent=2))
