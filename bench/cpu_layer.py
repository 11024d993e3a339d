"""The measured CPU layer of issue-level claims: what `odb_enable: true` alone does to a text
model's training time where it runs here, beside Standard and ODB's other attentions.

    python -m bench.cpu_layer [--repeats N] [--samples N] [--accumulation 8] [--cells ..] [--methods ..]

Real LLaMA-Factory training (`run_exp`, what `llamafactory-cli train` calls; all runs of one data
set in one torchrun, bench/lf_multi_run.py) on 2 CPU ranks (gloo) of a random text-only Qwen3
built here (hidden 256, 4 layers, intermediate 2048: 8 M parameters; compute, not framework
overhead, dominates its steps), on LLaMA-Factory's real `alpaca_en_demo` instruction rows from
shared/data, cut at two `cutoff_len`s, and the tiny Qwen3 (hidden 64, 2 layers), whose steps are
mostly a micro-batch's fixed cost:
  short              8 M model, cutoff 128 tokens (most rows cut: short instruction rows)
  long               8 M model, cutoff 1024 tokens (rows whole: mean ~300 tokens, length CV ~0.8)
  tiny               tiny Qwen3, cutoff 128 tokens
  short_qwen_vocab   the 8 M model's tower with a Qwen vocabulary (151,936 rows, tied: 46 M parameters),
  long_qwen_vocab    cutoff 128 / 1024: the LM head and its weight gradient, paid again by every
                     micro-batch, are most of a step, as in Qwen's small and mid-size models
  cv1_mean128_qwen_vocab, cv1_mean256_qwen_vocab
                     the 46 M model on alpaca rows whose responses are cut to lognormal lengths of
                     CV 1 (the paper profiles' spread) and mean 128 / 256 tokens: synthetic lengths,
                     real text (`cut_rows`)

Methods, one epoch each over the same training split, batch 1 per device × `--accumulation`:
  Standard                   LLaMA-Factory as it is
  Standard, batch = accum.   the same samples per optimizer step as one padded micro-batch per rank
  Standard, group_by_length  the same with `train_sampling_strategy: group_by_length` (a peer: transformers'
                             length-grouped sampler changes which samples share a step)
  ODB default                `odb_enable: true` and nothing else (auto: padding-free rows, per-segment attention,
                             odb_token_budget 1024 on CPU, logits at the supervised positions only)
  ODB default, eager         the same with `odb_lazy_preprocess: false`: rows tokenised before training, as
                             Standard's are (train_runtime then leaves the tokenisation out for both)
  ODB padded                 `odb_padding_free: false` (padded token-budgeted micro-batches)
  ODB default, budget 1024   `odb_token_budget: 1024` set explicitly (what `auto` picks here)
  ODB default, budget 4096   `odb_token_budget: 4096`, the accelerator's (and, before `auto`, every run's) budget:
                             one packed row a step on long rows (bench.row_size: a long packed row's per-token time
                             grows on this CPU once the ranks run short of memory)
  ODB default, all logits    `odb_supervised_logits: false`: logits at every position, as Standard computes them
                             (the control that isolates what leaving out the prompt positions' logits saves)
  ODB default + odb_balance  `odb_balance: true`: each optimizer step's samples re-dealt across the ranks so that
                             every rank's rows cost the same (OrchMLLM's post-balancing; the same samples per step;
                             what `odb_balance: auto`, the default since 2026-12-07, does on these 2 ranks)
  ODB default, no balance    `odb_balance: false`: each rank trains its own view's samples (the default before
                             2026-12-07; the control that isolates post-balancing)
  ODB padding-free + mask    `odb_padding_free: true`, `odb_packed_attention: mask` (transformers' dense block mask)
  ODB groups                 `odb_step: groups` (token-budgeted optimizer steps: another model)
All but group_by_length and ODB groups train the same samples in the same optimizer steps (the
eval loss after them is printed to check it). Repeats interleave the methods in a seeded random
order; throughput is train samples over HF's `train_runtime`; ratios are per repeat against that
repeat's Standard, median [min, max].
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Dict, List


import numpy as np

from .measured_runs import run_all
from .solvers import scaled_nnls
from .tables import md_table

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / ".cache" / "bench_cpu_layer"
MODEL = REPO / ".cache" / "cpu_layer_qwen3"
MODEL_QWEN_VOCAB = REPO / ".cache" / "cpu_layer_qwen3_qwen_vocab"
QWEN_VOCAB = 151936
RANKS = 2  # every run: measured_runs.run_all's torchrun of 2 CPU ranks
DEMO = REPO.parent / "shared" / "data" / "llamafactory_demo"
# cell -> (model, cutoff_len): the compute-dominated model on short and long rows, and the tiny
# Qwen3 (hidden 64, 2 layers: a micro-batch's fixed cost dominates its steps) on short rows
CELLS = {"short": ("8M", 128), "long": ("8M", 1024), "tiny": ("tiny", 128),
         "short_qwen_vocab": ("46M", 128), "long_qwen_vocab": ("46M", 1024),
         "cv1_mean128_qwen_vocab": ("46M", 1024), "cv1_mean256_qwen_vocab": ("46M", 1024)}
# cell -> (mean tokens, CV) of the lengths alpaca's rows are cut to (the others: the rows as they are)
CUT_ROWS = {"cv1_mean128_qwen_vocab": (128, 1.0), "cv1_mean256_qwen_vocab": (256, 1.0)}
# method -> (label, keys); "standard_batch": Standard's optimizer steps as one micro-batch of
# `accumulation` samples per rank (the same samples per step; the same model for a text model,
# whose loss is the step's global token mean), padded as LLaMA-Factory pads; "standard_by_length":
# the same with transformers' length-grouped sampler (a peer: its steps hold other samples)
METHODS = {"standard": ("Standard", {}),
           "standard_batch": ("Standard, batch = accumulation", {}),
           "standard_by_length": ("Standard, batch = accumulation, group_by_length",
                                  {"train_sampling_strategy": "group_by_length"}),
           "odb": ("ODB default", {"odb_enable": True}),
           "odb_eager": ("ODB default, eager preprocessing", {"odb_enable": True, "odb_lazy_preprocess": False}),
           "odb_padded": ("ODB padded", {"odb_enable": True, "odb_padding_free": False}),
           "odb_budget_1024": ("ODB default, odb_token_budget: 1024", {"odb_enable": True, "odb_token_budget": 1024}),
           "odb_budget_4096": ("ODB default, odb_token_budget: 4096", {"odb_enable": True, "odb_token_budget": 4096}),
           "odb_all_logits": ("ODB default, logits at every position", {"odb_enable": True,
                                                                         "odb_supervised_logits": False}),
           "odb_balance": ("ODB default + odb_balance", {"odb_enable": True, "odb_balance": True}),
           "odb_no_balance": ("ODB default, no balance", {"odb_enable": True, "odb_balance": False}),
           "odb_groups": ("ODB groups (token-budgeted optimizer steps)", {"odb_enable": True, "odb_step": "groups"}),
           "odb_mask": ("ODB padding-free + mask", {"odb_enable": True, "odb_padding_free": True,
                                                    "odb_packed_attention": "mask"})}
LAYER_CONFIG = {"hidden_size": 256, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 64}


def build_model(kind: str) -> Path:
    """The tiny Qwen3 ("tiny"), or its tokenizer and template with a compute-dominated text
    tower: "8M" with the tokenizer's own 2,048-token vocabulary, "46M" with a Qwen vocabulary
    (151,936 rows, tied embeddings as in Qwen3's small models; the tokenizer uses the first
    2,048), whose LM head and the gradient of its weights make most of a step's work."""
    from odb_factory.demo import tiny_qwen3
    from odb_factory.demo.tiny_model import build_tiny
    if kind == "tiny":
        return tiny_qwen3.build_tiny_qwen3(REPO / ".cache" / "tiny_qwen3", seed=0)

    def make_config(tok):
        config, ids = tiny_qwen3._make_config(tok)
        for key, value in LAYER_CONFIG.items():
            setattr(config, key, value)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        if kind == "46M":
            config.vocab_size, config.tie_word_embeddings = QWEN_VOCAB, True
        return config, ids
    name = "qwen3_cpu_layer" if kind == "8M" else "qwen3_cpu_layer_qwen_vocab"
    return build_tiny(MODEL if kind == "8M" else MODEL_QWEN_VOCAB, 0, False, name, "Qwen3ForCausalLM",
                      make_config, tiny_qwen3._make_processor)


def data_dir() -> Path:
    out = RUNS / "data"
    out.mkdir(parents=True, exist_ok=True)
    info = {"alpaca_en_demo": {"file_name": str(DEMO / "alpaca_en_demo.json")}}
    info.update({cell: {"file_name": str(out / f"{cell}.json")} for cell in CUT_ROWS})
    (out / "dataset_info.json").write_text(json.dumps(info))
    return out


def cut_rows(cell: str, model: Path, samples: int) -> Dict[str, float]:
    """Writes the cell's rows: alpaca's real instruction rows whose responses are cut so the rows'
    token lengths (prompt + response, this tokenizer) follow a lognormal of the cell's mean and
    CV (synthetic lengths, real text; a target longer than every row takes the longest rows
    whole). Returns the lengths' mean and CV as written."""
    from transformers import AutoTokenizer

    from odb_factory.synthetic import long_tail_lengths
    mean, cv = CUT_ROWS[cell]
    tok = AutoTokenizer.from_pretrained(model)
    rows = json.loads((DEMO / "alpaca_en_demo.json").read_text())
    prompt = [len(tok(r["instruction"] + r["input"])["input_ids"]) for r in rows]
    response = [tok(r["output"])["input_ids"] for r in rows]
    whole = sorted(range(len(rows)), key=lambda i: prompt[i] + len(response[i]))
    rng = random.Random(f"cut-rows:{cell}")
    out, lengths = [], []
    for target in long_tail_lengths(samples, cv, mean, seed=7, minimum=16, maximum=1024):
        fits = [i for i in whole if prompt[i] < target <= prompt[i] + len(response[i])]
        i = rng.choice(fits) if fits else whole[-1 - rng.randrange(8)]
        keep = response[i][:max(1, target - prompt[i])]
        out.append(dict(rows[i], output=tok.decode(keep)))
        lengths.append(prompt[i] + len(keep))
    (data_dir() / f"{cell}.json").write_text(json.dumps(out))
    return {"mean": statistics.mean(lengths), "cv": statistics.pstdev(lengths) / statistics.mean(lengths)}


def config(method: str, model: Path, cutoff: int, samples: int, accumulation: int, out: Path,
           dataset: str = "alpaca_en_demo") -> dict:
    batch, steps = (accumulation, 1) if method in ("standard_batch", "standard_by_length") else (1, accumulation)
    return {"model_name_or_path": str(model), "trust_remote_code": True, "stage": "sft", "do_train": True,
            "finetuning_type": "full", "dataset": dataset, "dataset_dir": str(data_dir()),
            "template": "qwen3_nothink", "cutoff_len": cutoff, "max_samples": samples, "val_size": 0.1,
            "do_eval": True, "eval_strategy": "no", "per_device_eval_batch_size": 4,
            "preprocessing_num_workers": 1, "dataloader_num_workers": 1, "output_dir": str(out),
            "overwrite_output_dir": True, "save_strategy": "no", "logging_steps": 1, "report_to": "none",
            "per_device_train_batch_size": batch, "gradient_accumulation_steps": steps,
            "learning_rate": 1e-4, "num_train_epochs": 1, "lr_scheduler_type": "cosine", "seed": 3,
            "use_cpu": True, "bf16": False, "disable_gradient_checkpointing": True, **METHODS[method][1]}


def run_dir(root: Path, cell: str, method: str, repeat: int) -> Path:
    return root / f"{cell.replace(' ', '_').replace(',', '')}_{method}_r{repeat}"


# the step model's terms; logit_tokens: the positions the LM head computes (runs recorded
# before it existed computed every position)
COLUMNS = ("micro_batches", "tokens", "sum_sq", "logit_tokens")


def optimizer_steps(method: str, out: Path, steps: int) -> List[dict]:
    """The run's optimizer steps from its `training_step` calls (bench/lf_multi_run.py, one file a
    rank; Standard calls it once a micro-batch): per step, each work term's maximum over the ranks
    (the slowest rank's), and the seconds the ranks spent in it (they meet at its end). Attention is
    priced as the run computes it: a packed row under the dense mask costs (Σ len)², not Σ len²."""
    ranks = [[json.loads(line) for line in f.read_text().splitlines()] for f in sorted(out.glob("steps_rank*.jsonl"))]
    calls_per_step = -(-len(ranks[0]) // steps)
    merged = []
    for calls in ranks:
        calls = [dict(c, logit_tokens=c.get("logit_tokens", c["tokens"])) for c in calls]
        merged.append([{k: sum(c[k] for c in calls[i:i + calls_per_step]) for k in calls[0]}
                       for i in range(0, len(calls), calls_per_step)])
        if method == "odb_mask":
            merged[-1] = [dict(s, sum_sq=s["tokens"] ** 2 / max(1, s["micro_batches"])) for s in merged[-1]]
    return [dict({k: max(s[k] for s in step) for k in COLUMNS}, time_s=sum(s["time_s"] for s in step) / len(step))
            for step in zip(*merged)]


def fit_coefficients(steps: List[dict], relative: bool = True) -> np.ndarray:
    """The step model's COLUMNS coefficients (NNLS, each >= 0) fitted to optimizer steps, on
    each step's relative error: a step of long rows (seconds more) does not outweigh one of short
    rows, so runs of several data sets fit a model that prices each of them, and the fixed cost
    per micro-batch that short rows show is not traded away for the long rows' tokens.
    `relative=False`: on the steps' seconds (the fit before 2026-12-07's third plan check)."""
    x = np.array([[s[k] for k in COLUMNS] for s in steps], dtype=float)
    seconds = np.array([s["time_s"] for s in steps], dtype=float)
    if not relative:
        return scaled_nnls(x, seconds)
    return scaled_nnls(x / seconds[:, None], np.ones_like(seconds))


def step_model_json(coef: np.ndarray, ranks: int, runs: List[str]) -> dict:
    """Fitted coefficients as `python -m odb_factory.dry_run --step-model` reads them
    (odb_factory.simulation.measured)."""
    c0, a, b, head = map(float, coef)
    # the runs train under DDP, which reduces gradients once per optimizer step
    return {"device": "cpu", "ranks": ranks, "ranks_meet": "optimizer_step", "c0_s_per_micro_batch": c0, "a_s_per_token": a,
            "b_s_per_token_sq": b, "head_s_per_logit_position": head, "fitted_on": runs}


def all_steps(root: Path, rows: List[dict]) -> List[dict]:
    """Every run's optimizer steps (`optimizer_steps`) in `root`."""
    return [s for r in rows for s in optimizer_steps(r["method"], run_dir(root, r["cell"], r["method"], r["repeat"]),
                                                     r["optimizer_steps"])]


def prediction_check(root: Path, rows: List[dict]) -> List[Dict[str, object]]:
    """The step model's form (c0 per micro-batch + a·tokens + b·attention + d·positions the LM
    head computes, NNLS) fitted per cell
    on every method's optimizer steps of the other repeats; each method's train time of the last
    repeat predicted from its steps, as a ratio to Standard's, against the measured ratio of
    train_runtime."""
    out = []
    for cell in CELLS:
        mine = {(r["method"], r["repeat"]): r for r in rows if r["cell"] == cell}
        if not mine:
            continue
        held = max(repeat for _, repeat in mine)
        steps = {key: optimizer_steps(key[0], run_dir(root, cell, *key), r["optimizer_steps"])
                 for key, r in mine.items()}
        coef = fit_coefficients([s for (_, repeat), calls in steps.items() if repeat != held for s in calls])

        def predicted(method: str) -> float:
            return float(sum(np.dot(coef, [s[k] for k in COLUMNS]) for s in steps[(method, held)]))
        for method in sorted({m for m, repeat in mine if repeat == held} - {"standard"}):
            want = mine[("standard", held)]["train_s"] / mine[(method, held)]["train_s"]
            got = predicted("standard") / predicted(method)
            out.append({"rows": cell, "method": METHODS[method][0], "measured × Standard": f"{want:.2f}",
                        "predicted × Standard": f"{got:.2f}", "error": f"{got / want - 1:+.0%}"})
    return out


def measure(root: Path, cells: List[str], methods: List[str], repeats: int, samples: int,
            accumulation: int, profile: bool = False) -> List[dict]:
    rows = []
    for cell in cells:
        kind, cutoff = CELLS[cell]
        model = build_model(kind)
        dataset = "alpaca_en_demo"
        if cell in CUT_ROWS:
            dataset = cell
            print(f"[cpu layer] {cell}: rows cut to token lengths {cut_rows(cell, model, samples)}",
                  file=sys.stderr, flush=True)
        plan, configs = [], []
        order = random.Random(f"cpu-layer:{cell}")
        for repeat in range(repeats):
            shuffled = list(methods)
            order.shuffle(shuffled)
            for method in shuffled:
                out = run_dir(root, cell, method, repeat)
                plan.append((method, repeat, out))
                configs.append(dict(config(method, model, cutoff, samples, accumulation, out, dataset),
                                    profile=profile))
        print(f"[cpu layer] {cell}: {len(configs)} runs in one torchrun", file=sys.stderr, flush=True)
        run_all(configs, root / f"{cell.replace(' ', '_').replace(',', '')}.log")
        for method, repeat, out in plan:
            results = json.loads((out / "all_results.json").read_text())
            steps = json.loads((out / "trainer_state.json").read_text())["global_step"]
            rows.append({"cell": cell, "method": method, "repeat": repeat,
                         "train_s": float(results["train_runtime"]), "eval_loss": results.get("eval_loss"),
                         "optimizer_steps": steps})
    return rows


def table(rows: List[dict]) -> List[Dict[str, object]]:
    out = []
    for cell in CELLS:
        mine = [r for r in rows if r["cell"] == cell]
        standard = {r["repeat"]: r for r in mine if r["method"] == "standard"}
        if not standard:
            continue
        std_loss = statistics.median(s["eval_loss"] for s in standard.values())
        for method, (label, _) in METHODS.items():
            runs = [r for r in mine if r["method"] == method and r["repeat"] in standard]
            if not runs:
                continue
            ratios = [standard[r["repeat"]]["train_s"] / r["train_s"] for r in runs]
            losses = [r["eval_loss"] for r in runs]
            out.append({"rows": cell, "method": label, "repeats": len(runs),
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
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--accumulation", type=int, default=8)
    parser.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, of {list(CELLS)}")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {list(METHODS)}")
    parser.add_argument("--name", default="runs", help="the runs go to .cache/bench_cpu_layer/NAME/")
    parser.add_argument("--profile", action="store_true",
                        help="each run also writes profile_rank<r>.txt (torch's profiler: CPU time by operator)")
    parser.add_argument("--fit-out", metavar="PATH", default=None,
                        help="also fit the step model to every run's optimizer steps and write it to PATH, "
                             "for python -m odb_factory.dry_run --step-model PATH")
    args = parser.parse_args(argv)
    methods = ["standard"] + [m for m in args.methods.split(",") if m != "standard"]
    root = RUNS / args.name
    root.mkdir(parents=True, exist_ok=True)
    rows = measure(root, args.cells.split(","), methods, args.repeats, args.samples, args.accumulation, args.profile)
    (root / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if args.fit_out:
        Path(args.fit_out).write_text(json.dumps(
            step_model_json(fit_coefficients(all_steps(root, rows)), RANKS, [args.name]), indent=1) + "\n")
    lines = table(rows)
    print(md_table(lines, [(k, k) for k in lines[0]]))
    if args.repeats > 1:
        check = prediction_check(root, rows)
        print("\nThe step model fitted on the other repeats, against the last repeat's train_runtime:\n")
        print(md_table(check, [(k, k) for k in check[0]]))
    return lines


if __name__ == "__main__":
    main()
