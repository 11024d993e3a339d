"""The dry run's predictions against the measured CPU layer: does `python -m odb_factory.dry_run`
predict, before any training, the speedup that `bench.cpu_layer` measures?

    python -m bench.plan_check --runs NAME,NAME,... [--out DIR]

NAME: an invocation of `bench.cpu_layer` (its runs in .cache/bench_cpu_layer/NAME). For each
invocation and ODB method in it, the step model is fitted (`bench.cpu_layer.fit_coefficients`)
on the optimizer steps of the invocations of *other* cells only (other data sets, whatever their
accumulation: the predicted data set's runs never price it), written as a measured step model, and
the dry run plans the recipe those runs trained with, for their 2 ranks, with it
(`--step-model`). Its predicted speedup stands beside the measured one (Standard's
train_runtime over the method's, per repeat: median [min, max]) and beside the dry run's
default prediction, which prices an H20 GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import yaml

from odb_factory.dry_run.__main__ import make_plan, parser as dry_run_parser

from .cpu_layer import METHODS, RANKS, RUNS, all_steps, fit_coefficients, step_model_json
from .tables import md_table

TOLERANCE = 0.20  # the bar: predictions within ±20% of the measured ratios


def invocation(name: str) -> dict:
    """One cpu_layer invocation: its rows (runs.jsonl), the recipe of each (cell, method) and
    its cells (data sets)."""
    root = RUNS / name
    rows = [json.loads(line) for line in (root / "runs.jsonl").read_text().splitlines()]
    recipes = {}
    for cell in {r["cell"] for r in rows}:
        for config in json.loads((root / f"{cell}.json").read_text()):
            method = Path(config["output_dir"]).name[len(cell) + 1:].rsplit("_r", 1)[0]
            recipes[(cell, method)] = as_it_ran(config)
    return {"name": name, "root": root, "rows": rows, "recipes": recipes, "cells": {cell for cell, _ in recipes}}


def as_it_ran(config: dict) -> dict:
    """The recipe with `odb_balance` as the run settled it: runs from before `odb_balance: auto`
    became the default (2026-12-07) trained without post-balancing, and the dry run would now
    plan the same keys with it. What ran is in the run's log (the balancer's figures)."""
    if not config.get("odb_enable") or "odb_balance" in config:
        return config
    history = json.loads((Path(config["output_dir"]) / "trainer_state.json").read_text())["log_history"]
    return dict(config, odb_balance=any("odb/balance_max_over_lb" in h for h in history))


def measured_ratios(rows: List[dict], cell: str, method: str) -> List[float]:
    standard = {r["repeat"]: r["train_s"] for r in rows if r["cell"] == cell and r["method"] == "standard"}
    return [standard[r["repeat"]] / r["train_s"] for r in rows
            if r["cell"] == cell and r["method"] == method and r["repeat"] in standard]


def planned_speedup(config: dict, step_model: Optional[Path], work: Path) -> Dict[str, object]:
    """The dry run of `config` (a recipe the runs trained with) for the runs' ranks: the
    predicted speedup of the recipe's odb_step mode, and the settings it planned."""
    recipe = work / "recipe.yaml"
    keys = {k: v for k, v in config.items() if k != "profile"}  # profile: bench.lf_multi_run's, not LLaMA-Factory's
    recipe.write_text(yaml.safe_dump(dict(keys, output_dir=str(work / "out"))))
    argv = [str(recipe), "--world-size", str(RANKS), "--workers", "0", "--no-progress"]
    plan = make_plan(dry_run_parser().parse_intermixed_args(argv + (["--step-model", str(step_model)]
                                                                    if step_model else [])))
    mode = plan["settings"]["odb_step"]
    return {"speedup": plan["speedup"][mode]["speedup"], "mode": mode,
            "budget": plan["settings"]["odb_token_budget"], "padding_free": plan["settings"]["odb_padding_free"],
            "supervised_logits": plan["speedup"]["supervised_logits"].get(mode)}


def check(names: List[str], out: Optional[Path], skip: Set[Tuple[str, str]] = frozenset(),
          relative: bool = True) -> List[Dict[str, object]]:
    """`skip`: (invocation, method) pairs not predicted (runs of code that has changed since;
    their steps still enter the fits of other cells, as the work they measured). `relative`:
    the fit's error measure (`bench.cpu_layer.fit_coefficients`)."""
    runs = [invocation(n) for n in names]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for target in runs:
            others = [r for r in runs if not (r["cells"] & target["cells"])]
            if not others:
                raise SystemExit(f"{target['name']}: no invocation of another cell to fit the step model on")
            steps = [s for r in others for s in all_steps(r["root"], r["rows"])]
            fitted = step_model_json(fit_coefficients(steps, relative), RANKS, [r["name"] for r in others])
            model = (out or work) / f"{target['name']}.step_model.json"
            model.write_text(json.dumps(fitted, indent=1) + "\n")
            for (cell, method), config in sorted(target["recipes"].items()):
                if not config.get("odb_enable") or (target["name"], method) in skip:
                    continue
                ratios = measured_ratios(target["rows"], cell, method)
                ours = planned_speedup(config, model, work)
                h20 = planned_speedup(config, None, work)
                want = statistics.median(ratios)
                lines.append({
                    "invocation": target["name"], "rows": cell,
                    "accumulation": config["gradient_accumulation_steps"], "method": METHODS[method][0],
                    "measured × Standard": f"{want:.2f} [{min(ratios):.2f}, {max(ratios):.2f}]",
                    "dry run, measured step model": f"{ours['speedup']:.2f}",
                    "error": f"{ours['speedup'] / want - 1:+.0%}",
                    "dry run, H20 step model": f"{h20['speedup']:.2f} (budget {h20['budget']})",
                    "planned": f"{ours['mode']}, budget {ours['budget']}, padding-free {ours['padding_free']}, "
                               f"supervised logits {ours['supervised_logits']}",
                    "fitted on": ", ".join(fitted["fitted_on"]), "within": abs(ours["speedup"] / want - 1) <= TOLERANCE})
    return lines


def main(argv=None) -> List[Dict[str, object]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", required=True, help="comma-separated invocation names under .cache/bench_cpu_layer/")
    p.add_argument("--skip", default="", help="comma-separated INVOCATION:METHOD runs not to predict "
                                              "(measured before a change to what they run)")
    p.add_argument("--fit-on", choices=("relative", "seconds"), default="relative",
                   help="the step model's fit: on each step's relative error (the default) or on its seconds")
    p.add_argument("--out", default=None, help="also write the table (plan_check.md, .json) and the fitted models here")
    a = p.parse_args(argv)
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    skip = {tuple(item.split(":", 1)) for item in a.skip.split(",") if item}
    lines = check(a.runs.split(","), out, skip, relative=a.fit_on == "relative")
    inside = sum(line.pop("within") for line in lines)
    table = md_table(lines, [(k, k) for k in lines[0]])
    summary = f"{inside} of {len(lines)} predictions within ±{TOLERANCE:.0%} of the measured median ratio"
    print(table + "\n\n" + summary)
    if out:
        (out / "plan_check.md").write_text(table + "\n\n" + summary + "\n")
        (out / "plan_check.json").write_text(json.dumps(lines, indent=1) + "\n")
    return lines


if __name__ == "__main__":
    main()
