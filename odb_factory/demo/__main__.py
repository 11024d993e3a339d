"""`make demo`: the main job on the embedded default, offline, on 2 CPU ranks.

Builds (once) a tiny random Qwen3-VL and a generated mixed text/image data set with very
different lengths and trains it three times with stock `llamafactory-cli`, the same recipe
settings each time (batch 1 × accumulation 4 per rank): Standard (LLaMA-Factory as
shipped), ODB `odb_step: samples` (the same optimizer steps and loss as Standard, packed
into fewer micro-batches) and ODB `odb_step: groups` (the paper's: 4 token-budgeted groups
per rank and optimizer step). It prints samples/s, optimizer steps, the last training loss
and the eval loss of each, side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .synthetic_data import write_demo_dataset
from .tiny_model import build_tiny_qwen3vl

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
RUNS = [("Standard", "recipes/tiny/qwen3vl_tiny_standard.yaml"),
        ("ODB samples", "recipes/tiny/qwen3vl_tiny_odb_samples.yaml"),
        ("ODB groups", "recipes/tiny/qwen3vl_tiny_odb.yaml")]
# The same run settings for all three: the whole demo set (tens of seconds of training, so
# start-up does not dominate samples/s), a held-out tenth, batch 1 × accumulation 4.
OVERRIDES = ["max_samples=512", "val_size=0.1", "do_eval=true",
             "per_device_eval_batch_size=4", "per_device_train_batch_size=1",
             "gradient_accumulation_steps=4"]


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _output_dir(recipe: Path) -> Path:
    for line in recipe.read_text().splitlines():
        if line.startswith("output_dir:"):
            return REPO / line.split(":", 1)[1].strip()
    raise ValueError(f"{recipe} has no output_dir")


def run(label: str, recipe: str) -> dict:
    path = REPO / recipe
    log = CACHE / "runs" / f"{path.stem}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[demo] {label}: llamafactory-cli train {recipe} (2 CPU ranks) ... log: {log.relative_to(REPO)}",
          flush=True)
    start = time.time()
    with log.open("w") as f:
        proc = subprocess.run([str(Path(sys.executable).parent / "llamafactory-cli"), "train", recipe, *OVERRIDES],
                              cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"[demo] {label} failed (exit {proc.returncode}); end of {log}:\n{tail}")
    out = _output_dir(path)
    results = json.loads((out / "train_results.json").read_text())
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    steps = max(h.get("step", 0) for h in history)
    efficiency = [h["odb/padding_efficiency"] for h in history if "odb/padding_efficiency" in h]
    losses = [h["loss"] for h in history if "loss" in h]
    eval_loss = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    return {"label": label, "samples_per_s": results["train_samples_per_second"],
            "runtime_s": results["train_runtime"], "optimizer_steps": steps,
            "last_loss": losses[-1], "eval_loss": eval_loss,
            "padding_efficiency": sum(efficiency) / len(efficiency) if efficiency else None,
            "wall_s": time.time() - start}


def main() -> None:
    model = build_tiny_qwen3vl(CACHE / "tiny_qwen3vl", seed=0)
    stats = write_demo_dataset(CACHE / "odb_demo_data", seed=0)
    print(f"[demo] tiny Qwen3-VL at {model.relative_to(REPO)}; {stats['num_samples']} samples, "
          f"length CV {stats['length_cv']:.2f}", flush=True)
    rows = [run(label, recipe) for label, recipe in RUNS]
    standard = rows[0]
    print("\n| method | emitted samples/s | vs Standard | train time (s) | optimizer steps | "
          "last train loss | eval loss | padding efficiency |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        eff = f"{r['padding_efficiency']:.3f}" if r["padding_efficiency"] is not None else "n/a"
        print(f"| {r['label']} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / standard['samples_per_s']:.2f}x "
              f"| {r['runtime_s']:.2f} | {r['optimizer_steps']} | {r['last_loss']:.4f} | {r['eval_loss']:.4f} | {eff} |")
    same = rows[1]
    drift = abs(same["eval_loss"] - standard["eval_loss"]) / standard["eval_loss"]
    print(f"\nODB samples vs Standard: {same['optimizer_steps']} vs {standard['optimizer_steps']} optimizer "
          f"steps, eval loss {same['eval_loss']:.4f} vs {standard['eval_loss']:.4f} "
          f"({'the same model' if drift < 1e-3 else f'relative difference {drift:.1e}'}).")
    groups = rows[2]
    print(f"ODB groups: {groups['optimizer_steps']} optimizer steps, eval loss {groups['eval_loss']:.4f} "
          f"({(groups['eval_loss'] / standard['eval_loss'] - 1) * 100:+.1f}% vs Standard at the same "
          "learning rate). All-rank samples / train wall-clock, 2 CPU ranks, gloo.")

if __name__ == "__main__":
    main()
