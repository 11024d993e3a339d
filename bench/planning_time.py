"""Planning time per step at scale: what one rank computes for every step of a round when
every rank holds `--samples` samples in its window (grouping, alignment, global grouping,
post-balancing with placement), measured in one process.

    python -m bench.planning_time [--ranks 64] [--samples 64] [--rounds 20]

Each rank runs the same pure planner code on the same gathered costs, so one rank's time is
the time every rank spends; the collectives are not included (they gather W·B integers).
Lengths: a long-tailed synthetic profile (CV 1.0, mean 1500, max 16384; synthetic).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

from odb_factory import SampleCost
from odb_factory.balance.step_plan import StepBalance, plan_step
from odb_factory.planning.global_grouping import apply_layout, regroup_round
from odb_factory.planning.grouping import Budget
from odb_factory.planning.rounds import RankPlanner
from odb_factory.planning.simulated_world import planned_stream
from odb_factory.synthetic import long_tail_lengths


def one_round(world: int, window: int, budget: Budget, seed: int) -> Dict[str, float]:
    lengths = long_tail_lengths(world * window, cv=1.0, mean=1500, seed=seed, maximum=16384)
    costs = [SampleCost(int(n), int(n) // 2) for n in lengths]
    planners = [RankPlanner(budget, window, planned_stream(range(r * window, (r + 1) * window), costs), rank=r)
                for r in range(world)]
    started = time.perf_counter()
    statuses = [p.begin_round() for p in planners]
    slot_costs = [p.plan_round(statuses) for p in planners]
    results = [p.close_round(slot_costs) for p in planners]
    own = (time.perf_counter() - started) / world  # grouping + alignment: each rank does its own
    started = time.perf_counter()
    layout = regroup_round(results[0].costs, budget, ranks_per_node=8, seed=str(seed))
    regroup = time.perf_counter() - started
    laid_out = apply_layout(layout, results[0].costs) if layout is not None else results[0].costs
    mode = "padded" if budget.cost_mode == "padded" else "lpt"
    spec = StepBalance(mode=mode, ranks_per_node=8, token_budget=budget.token_budget if mode == "padded" else None)
    started = time.perf_counter()
    for p in range(len(laid_out[0])):
        plan_step([laid_out[r][p] for r in range(world)], spec)
    balance = time.perf_counter() - started
    steps = len(laid_out[0])
    return {"steps": steps, "grouping + alignment": own / steps, "global grouping": regroup / steps,
            "post-balancing": balance / steps, "total": (own + regroup + balance) / steps}


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args(argv)
    one_round(4, 8, Budget(16384), 0)  # imports and first-call costs out of the figures
    rows = []
    for mode in ("padded", "packed"):
        runs = [one_round(a.ranks, a.samples, Budget(16384, mode), seed) for seed in range(a.rounds)]
        row = {"budget": f"16384 {mode}", "ranks × samples": f"{a.ranks} × {a.samples}",
               "steps per round": statistics.median(r["steps"] for r in runs)}
        for key in ("grouping + alignment", "global grouping", "post-balancing", "total"):
            values = sorted(r[key] * 1e3 for r in runs)
            row[f"{key} ms/step (median, max)"] = f"{statistics.median(values):.2f}, {values[-1]:.2f}"
        rows.append(row)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    return rows


if __name__ == "__main__":
    main()
