"""Engine benchmark: batching quality, planning throughput and loader throughput.

    python -m bench.engine [--quick] [--loader-only] [--repeats N]

Side by side on the same samples, in one process:
  * padding efficiency, steps and peak padded tokens of a fixed-batch baseline, the peer
    package's grouping (online-dynamic-batching==0.1.2, when installed, as a comparator
    only) and ODB (8 simulated ranks through the real planner);
  * planning throughput (samples/s through grouping + alignment);
  * loader throughput: ODBDataLoader vs a plain DataLoader on the same dataset, collate
    function and sample workers, at ODB's mean batch size, on synthetic token samples and on
    LLaMA-Factory's lazy pipeline (tiny Qwen3-VL, generated demo set).
Batching profiles: generated long tails with CV 0.3 / 0.5 / 1.0, and the real LLaMA-Factory
demo sets (bench.demo_workload.DEMO_DIR, skipped when absent) with one token per UTF-8 byte.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from odb_factory import ODBBatch, ODBConfig, ODBDataLoader, SampleCost
from odb_factory.planning.simulated_world import simulate_epoch
from odb_factory.synthetic import LengthDataset, long_tail_lengths, pad_collate

from .demo_workload import DEMO_DIR

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


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


# ------------------------------------------------------------------ loader throughput
class Workload(NamedTuple):
    name: str
    dataset: Any
    collate: Callable
    budget: int        # ODB token budget
    buffer_size: int   # ODB planning window


def synthetic_workload(n: int) -> Workload:
    """Token samples of 16-1024 tokens (long tail, CV 1.0), right-padded into tensors."""
    lengths = long_tail_lengths(n, cv=1.0, mean=300, seed=3, minimum=16, maximum=1024)
    return Workload("synthetic", LengthDataset(lengths), pad_collate, 4096, 256)


def llamafactory_workload(n: int) -> Optional[Workload]:
    """LLaMA-Factory's own lazy pipeline (odb_factory.llamafactory.lazy_dataset: template,
    tokenizer and image processor per sample) and its SFT collator, as the ODB recipe
    recipes/tiny/qwen3vl_tiny_odb.yaml configures them: the tiny Qwen3-VL on the generated
    demo set (the measured layer's model and data). None without LLaMA-Factory."""
    try:
        import llamafactory.train.tuner  # noqa: F401  (the import hook patches LLaMA-Factory here)
    except ImportError:
        return None
    import tempfile
    import odb_factory_patches
    import yaml
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer
    from odb_factory.demo.synthetic_data import write_demo_dataset
    from odb_factory.demo.tiny_model import build_tiny_qwen3vl
    from odb_factory.llamafactory.train_loader import LFCollate
    odb_factory_patches.apply()
    recipe = yaml.safe_load((REPO / "recipes/tiny/qwen3vl_tiny_odb.yaml").read_text())
    build_tiny_qwen3vl(REPO / recipe["model_name_or_path"], seed=0)
    if not (REPO / recipe["dataset_dir"] / "dataset_info.json").exists():
        write_demo_dataset(REPO / recipe["dataset_dir"], seed=0)
    config = dict(recipe, model_name_or_path=str(REPO / recipe["model_name_or_path"]),
                  dataset_dir=str(REPO / recipe["dataset_dir"]), max_samples=n,
                  output_dir=tempfile.mkdtemp(prefix="odb_engine_"))
    model_args, data_args, training_args, finetuning_args, _ = get_train_args(config)
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    dataset = get_dataset(template, model_args, data_args, training_args, "sft",
                          **tokenizer_module)["train_dataset"]
    model = load_model(tokenizer_module["tokenizer"], model_args, finetuning_args, is_trainable=False)
    collator = SFTDataCollatorWith4DAttentionMask(
        template=template, model=model, pad_to_multiple_of=8, label_pad_token_id=-100,
        block_diag_attn=model_args.block_diag_attn,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        compute_dtype=model_args.compute_dtype, **tokenizer_module)
    return Workload("LLaMA-Factory lazy", dataset, LFCollate(collator), recipe["odb_token_budget"],
                    recipe["odb_buffer_size"])


def samples_per_s(loader) -> float:
    start, n = time.perf_counter(), 0
    for batch in loader:
        n += batch.num_samples if isinstance(batch, ODBBatch) else len(batch["input_ids"])
    return n / (time.perf_counter() - start)


def loader_throughput(work: Workload, workers: int, repeats: int) -> List[dict]:
    """Samples/s of ODBDataLoader (0 and 2 collate workers) beside a plain DataLoader with
    the same dataset, collate function and sample workers, at ODB's mean batch size.
    Epochs alternate between the loaders; each repeat gives one ratio per ODB loader."""
    odb = {c: ODBDataLoader(work.dataset, ODBConfig(token_budget=work.budget, buffer_size=work.buffer_size),
                            collate_fn=work.collate, num_workers=workers, num_collate_workers=c)
           for c in (0, 2)}
    steps = [s for s in odb[0] if not s.is_idle]   # also warms ODB's workers up
    batch = max(1, round(sum(s.num_samples for s in steps) / len(steps)))
    plain = torch.utils.data.DataLoader(work.dataset, batch_size=batch, shuffle=True,
                                        num_workers=workers, collate_fn=work.collate,
                                        persistent_workers=workers > 0)
    for loader in (plain, odb[2]):
        samples_per_s(loader)                      # warm-up epoch
    loaders = {"plain": plain, **odb}
    rates: Dict[Any, List[float]] = {name: [] for name in loaders}
    for _ in range(repeats):
        for name, loader in loaders.items():
            rates[name].append(samples_per_s(loader))
    for loader in odb.values():
        loader.close()
    rows = []
    for c in (0, 2):
        ratios = [o / p for o, p in zip(rates[c], rates["plain"])]
        rows.append({"workload": work.name, "sample workers": workers, "collate workers": c,
                     "batch": batch, "plain samples/s": statistics.median(rates["plain"]),
                     "odb samples/s": statistics.median(rates[c]),
                     "odb/plain (median)": statistics.median(ratios),
                     "min": min(ratios), "max": max(ratios), "repeats": repeats})
    return rows


def loader_section(quick: bool, repeats: int) -> str:
    works = [synthetic_workload(4000 if quick else 20000)]
    lf = llamafactory_workload(256 if quick else 512)
    works += [lf] if lf is not None else []
    rows = [row for work in works for workers in (0, 2)
            for row in loader_throughput(work, workers, repeats)]
    note = "" if lf is not None else "\n\n(LLaMA-Factory is not installed: its pipeline is skipped.)"
    return ("## Loader throughput: ODBDataLoader vs a plain DataLoader at ODB's mean batch size\n\n"
            f"World size 1; epochs alternate between the loaders, {repeats} repeats; odb/plain is "
            "the per-repeat ratio (median, min, max).\n\n" + markdown(rows) + note)


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
    parser.add_argument("--loader-only", action="store_true", help="only the loader throughput")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed epochs per loader (default: 3 quick, 5 full)")
    args = parser.parse_args(argv)
    report = []
    if not args.loader_only:
        n = 2000 if args.quick else 20000
        profiles = {f"long-tail cv {c}": long_tail_lengths(n, cv=c, mean=400, seed=7, maximum=8192)
                    for c in (0.3, 0.5, 1.0)}
        profiles.update(demo_lengths())
        rows = batching_table(profiles, budget=8192, world=8, window=256)
        report += ["## Batching on the same samples (budget 8192 tokens, window 256)", markdown(rows)]
    report.append(loader_section(args.quick, args.repeats or (3 if args.quick else 5)))
    text = "\n\n".join(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine.md").write_text(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
