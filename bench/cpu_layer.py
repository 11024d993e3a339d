"""The measured CPU layer of issue-level claims: what `odb_enable: true` alone does to a text
model's training time where it runs here, beside Standard and ODB's other attentions.

    python -m bench.cpu_layer [--repeats N] [--samples N] [--accumulation 8]

Real LLaMA-Factory training (`run_exp`, what `llamafactory-cli train` calls; all runs of one data
set in one torchrun, bench/lf_multi_run.py) on 2 CPU ranks (gloo) of a random text-only Qwen3
built here (hidden 256, 4 layers, intermediate 2048: 8 M parameters; compute, not framework
overhead, dominates its steps), on LLaMA-Factory's real `alpaca_en_demo` instruction rows from
shared/data, cut at two `cutoff_len`s:
  short   cutoff 128 tokens (most rows cut: short instruction rows)
  long    cutoff 1024 tokens (rows whole: mean ~300 tokens, length CV ~0.8)

Methods, one epoch each over the same training split, batch 1 per device × `--accumulation`:
  Standard                   LLaMA-Factory as it is
  ODB default                `odb_enable: true` and nothing else (auto: padding-free rows, per-segment attention)
  ODB default, eager         the same with `odb_lazy_preprocess: false`: rows tokenised before training, as
                             Standard's are (train_runtime then leaves the tokenisation out for both)
  ODB padded                 `odb_padding_free: false` (padded token-budgeted micro-batches)
  ODB padding-free + mask    `odb_padding_free: true`, `odb_packed_attention: mask` (transformers' dense block mask)
All train the same samples in the same optimizer steps (the eval loss after them is printed to
check it). Repeats interleave the methods in a seeded random order; throughput is train samples
over HF's `train_runtime`; ratios are per repeat against that repeat's Standard, median [min, max].
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Dict, List


from .measured_runs import run_all
from .tables import md_table

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / ".cache" / "bench_cpu_layer"
MODEL = REPO / ".cache" / "cpu_layer_qwen3"
DEMO = REPO.parent / "shared" / "data" / "llamafactory_demo"
CUTOFFS = {"short": 128, "long": 1024}
METHODS = {"Standard": {},
           "ODB default": {"odb_enable": True},
           "ODB default, eager preprocessing": {"odb_enable": True, "odb_lazy_preprocess": False},
           "ODB padded": {"odb_enable": True, "odb_padding_free": False},
           "ODB padding-free + mask": {"odb_enable": True, "odb_padding_free": True, "odb_packed_attention": "mask"}}
LAYER_CONFIG = {"hidden_size": 256, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 64}


def build_model() -> Path:
    """The tiny Qwen3's tokenizer and template with a compute-dominated text tower."""
    from odb_factory.demo import tiny_qwen3
    from odb_factory.demo.tiny_model import build_tiny

    def make_config(tok):
        config, ids = tiny_qwen3._make_config(tok)
        for key, value in LAYER_CONFIG.items():
            setattr(config, key, value)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        return config, ids
    return build_tiny(MODEL, 0, False, "qwen3_cpu_layer", "Qwen3ForCausalLM", make_config,
                      tiny_qwen3._make_processor)


def data_dir() -> Path:
    out = RUNS / "data"
    out.mkdir(parents=True, exist_ok=True)
    (out / "dataset_info.json").write_text(json.dumps(
        {"alpaca_en_demo": {"file_name": str(DEMO / "alpaca_en_demo.json")}}))
    return out


def config(method: str, cutoff: int, samples: int, accumulation: int, out: Path) -> dict:
    return {"model_name_or_path": str(MODEL), "trust_remote_code": True, "stage": "sft", "do_train": True,
            "finetuning_type": "full", "dataset": "alpaca_en_demo", "dataset_dir": str(data_dir()),
            "template": "qwen3_nothink", "cutoff_len": cutoff, "max_samples": samples, "val_size": 0.1,
            "do_eval": True, "eval_strategy": "no", "per_device_eval_batch_size": 4,
            "preprocessing_num_workers": 1, "dataloader_num_workers": 1, "output_dir": str(out),
            "overwrite_output_dir": True, "save_strategy": "no", "logging_steps": 1, "report_to": "none",
            "per_device_train_batch_size": 1, "gradient_accumulation_steps": accumulation,
            "learning_rate": 1e-4, "num_train_epochs": 1, "lr_scheduler_type": "cosine", "seed": 3,
            "use_cpu": True, "bf16": False, "disable_gradient_checkpointing": True, **METHODS[method]}


def measure(repeats: int, samples: int, accumulation: int) -> List[dict]:
    build_model()
    rows = []
    for data, cutoff in CUTOFFS.items():
        plan, configs = [], []
        order = random.Random(f"cpu-layer:{data}")
        for repeat in range(repeats):
            methods = list(METHODS)
            order.shuffle(methods)
            for method in methods:
                out = RUNS / f"{data}_{method.replace(' ', '_').replace('+', 'and')}_r{repeat}"
                plan.append((method, repeat, out))
                configs.append(config(method, cutoff, samples, accumulation, out))
        print(f"[cpu layer] {data} rows: {len(configs)} runs in one torchrun", file=sys.stderr, flush=True)
        run_all(configs, RUNS / f"{data}.log")
        for method, repeat, out in plan:
            results = json.loads((out / "all_results.json").read_text())
            steps = json.loads((out / "trainer_state.json").read_text())["global_step"]
            rows.append({"data": data, "method": method, "repeat": repeat,
                         "train_s": float(results["train_runtime"]), "eval_loss": results.get("eval_loss"),
                         "optimizer_steps": steps})
    return rows


def table(rows: List[dict]) -> List[Dict[str, object]]:
    out = []
    for data in CUTOFFS:
        mine = [r for r in rows if r["data"] == data]
        standard = {r["repeat"]: r for r in mine if r["method"] == "Standard"}
        for method in METHODS:
            runs = [r for r in mine if r["method"] == method]
            ratios = [standard[r["repeat"]]["train_s"] / r["train_s"] for r in runs]
            losses = [r["eval_loss"] for r in runs]
            std_loss = statistics.median(s["eval_loss"] for s in standard.values())
            out.append({"rows": data, "method": method, "repeats": len(runs),
                        "train s, median": f"{statistics.median(r['train_s'] for r in runs):.1f}",
                        "× Standard, median [min, max]": f"{statistics.median(ratios):.2f} "
                                                         f"[{min(ratios):.2f}, {max(ratios):.2f}]",
                        "optimizer steps": "/".join(sorted({str(r["optimizer_steps"]) for r in runs})),
                        "eval loss": f"{statistics.median(losses):.6f}",
                        "eval loss rel. diff to Standard": f"{max(abs(x - std_loss) / std_loss for x in losses):.1e}"})
    return out


def main(argv=None) -> List[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--accumulation", type=int, default=8)
    args = parser.parse_args(argv)
    rows = measure(args.repeats, args.samples, args.accumulation)
    RUNS.mkdir(parents=True, exist_ok=True)
    (RUNS / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = table(rows)
    print(md_table(lines, [(k, k) for k in lines[0]]))
    return lines


if __name__ == "__main__":
    main()
