"""Engine benchmark: batching quality, planning throughput and loader throughput.

    python -m bench.engine [--quick]

Side by side on the same samples, in one process:
  * padding efficiency, steps and peak padded tokens of a fixed-batch baseline, the peer
    package's grouping (online-dynamic-batching==0.1.2, when installed, as a comparator
    only) and ODB (8 simulated ranks through the real planner);
  * planning throughput (samples/s through grouping + alignment);
  * loader throughput: ODBDataLoader vs a plain DataLoader on the same dataset and workers.
Profiles: generated long tails with CV 0.3 / 0.5 / 1.0, and the real LLaMA-Factory demo
sets (bench.demo_workload.DEMO_DIR, skipped when absent) with one token per UTF-8 byte.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from odb_factory import ODBConfig, ODBDataLoader, SampleCost
from odb_factory.planning.simulated_world import simulate_epoch
from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate

from .demo_workload import DEMO_DIR

RESULTS = Path(__file__).resolve().parent / "results"


def demo_lengths() -> Dict[str, List[int]]:
    """Byte lengths of the real demo conversations (a byte-level tokenizer's token count)."""
    out = {}
    for name in ("alpaca_en_demo", "glaive_toolcall_en_demo"):
        path = DEMO_DIR / f"{name}.json"
        if not path.exists():
            continue
        rows = json.loads(path.read_text())
        out[name] = [len(json.dumps(row, ensure_ascii=False).encode()) for row in rows]
    return out


def cv(values: Sequence[int]) -> float:
    return statistics.pstdev(values) / statistics.mean(values)


def fixed_batches(lengths: Sequence[int], budget: int, seed: int = 0):
    """Standard: random order, the largest fixed batch that never exceeds the budget."""
    batch = max(1, budget // max(lengths))
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def peer_batches(lengths: Sequence[int], budget: int, window: int):
    try:
        from odb.grouping import grouping_data
    except ImportError:
        return None
    groups = []
    pending = [{"input_ids": [0] * l, "_i": i} for i, l in enumerate(lengths)]
    while pending:
        window_samples, pending = pending[:window], pending[window:]
        grouped, overflow, *_ = grouping_data([window_samples], budget, None, is_finished=not pending)
        groups += [[s["_i"] for s in g] for g in grouped]
        pending = overflow + pending if overflow and pending else pending
        if overflow and not pending:
            groups += [[s["_i"]] for s in overflow]
    return groups


def summarise(name: str, groups, lengths, budget: int) -> Dict[str, float]:
    real = sum(lengths[i] for g in groups for i in g)
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups if g)
    peak = max(len(g) * max(lengths[i] for i in g) for g in groups if g)
    return {"method": name, "micro_batches": len(groups), "padding_eff": real / padded,
            "budget_fill": real / (budget * len(groups)),
            "peak_tokens": peak, "over_budget_steps": sum(
                1 for g in groups if len(g) > 1 and len(g) * max(lengths[i] for i in g) > budget)}


def batching_table(profiles: Dict[str, List[int]], budget: int, world: int, window: int):
    rows = []
    for profile, lengths in profiles.items():
        costs = [SampleCost(l, l) for l in lengths]
        cfg = ODBConfig(token_budget=budget, buffer_size=window)
        results = [summarise("standard", fixed_batches(lengths, budget), lengths, budget)]
        peer = peer_batches(lengths, budget, window)
        if peer is not None:
            results.append(summarise("peer odb 0.1.2 (1 rank)", peer, lengths, budget))
        for ranks in (1, world):
            start = time.perf_counter()
            sim = simulate_epoch(costs, cfg, ranks)
            plan_s = time.perf_counter() - start
            groups = [[s.index for s in slot.samples] for r in sim.slots for slot in r]
            odb = summarise(f"odb ({ranks} rank{'s' if ranks > 1 else ''})", groups, lengths, budget)
            odb["idle_steps"] = sum(slot.is_idle for r in sim.slots for slot in r)
            odb["plan_samples_per_s"] = len(lengths) / plan_s
            results.append(odb)
        for r in results:
            rows.append({"profile": profile, "n": len(lengths), "cv": round(cv(lengths), 2), **r})
    return rows


def loader_throughput(lengths: Sequence[int], budget: int, workers: int, repeats: int) -> Dict[str, float]:
    """Samples/s delivered by each loader (same dataset, same workers), median of repeats."""
    ds = LengthDataset(lengths)
    batch = max(1, budget // max(lengths))
    out = {"plain": [], "odb": []}
    plain = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                        collate_fn=pad_collate, persistent_workers=workers > 0)
    odb = ODBDataLoader(ds, ODBConfig(token_budget=budget, buffer_size=128), collate_fn=pad_collate,
                        num_workers=workers, num_collate_workers=1 if workers else 0)
    for _ in range(repeats):
        for name, loader in (("plain", plain), ("odb", odb)):
            start = time.perf_counter()
            n = sum(len(b["index"]) if name == "plain" else b.num_samples for b in loader)
            out[name].append(n / (time.perf_counter() - start))
    odb.close()
    return {k: statistics.median(v) for k, v in out.items()}


def markdown(rows: List[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(
            f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    n = 2000 if args.quick else 20000
    profiles = {f"long-tail cv {c}": long_tail_lengths(n, cv=c, mean=400, seed=7, maximum=8192)
                for c in (0.3, 0.5, 1.0)}
    profiles.update(demo_lengths())
    rows = batching_table(profiles, budget=8192, world=8, window=256)
    report = ["## Batching on the same samples (budget 8192 tokens, window 256)", markdown(rows)]
    throughput = loader_throughput(long_tail_lengths(1500 if args.quick else 6000, cv=1.0, mean=300,
                                                     seed=3, maximum=4096),
                                   budget=4096, workers=2, repeats=1 if args.quick else 3)
    report += ["## Loader throughput (samples/s, 2 workers, same dataset)",
               markdown([{**throughput, "odb/plain": throughput["odb"] / throughput["plain"]}])]
    text = "\n\n".join(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine.md").write_text(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
