"""`make demo`: the main job on the embedded default, offline, on 2 CPU ranks.

Builds (once) a tiny random Qwen3-VL and a generated mixed text/image data set with very
different lengths, trains it with stock `llamafactory-cli` and ODB, then with the Standard
fixed-batch recipe on the same data, and prints the emitted samples/s of both.
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
RUNS = [("ODB (join)", "recipes/tiny/qwen3vl_tiny_odb.yaml"),
        ("Standard", "recipes/tiny/qwen3vl_tiny_standard.yaml")]


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
        proc = subprocess.run([str(Path(sys.executable).parent / "llamafactory-cli"), "train", recipe],
                              cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"[demo] {label} failed (exit {proc.returncode}); end of {log}:\n{tail}")
    out = _output_dir(path)
    results = json.loads((out / "train_results.json").read_text())
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    steps = max(h.get("step", 0) for h in history)
    efficiency = [h["odb/padding_efficiency"] for h in history if "odb/padding_efficiency" in h]
    return {"label": label, "samples_per_s": results["train_samples_per_second"],
            "runtime_s": results["train_runtime"], "optimizer_steps": steps,
            "padding_efficiency": sum(efficiency) / len(efficiency) if efficiency else None,
            "wall_s": time.time() - start}


def main() -> None:
    model = build_tiny_qwen3vl(CACHE / "tiny_qwen3vl", seed=0)
    stats = write_demo_dataset(CACHE / "odb_demo_data", seed=0)
    print(f"[demo] tiny Qwen3-VL at {model.relative_to(REPO)}; {stats['num_samples']} samples, "
          f"length CV {stats['length_cv']:.2f}", flush=True)
    rows = [run(label, recipe) for label, recipe in RUNS]
    odb, standard = rows
    print("\n| method | emitted samples/s | train time (s) | optimizer steps | padding efficiency |")
    print("|---|---|---|---|---|")
    for r in rows:
        eff = f"{r['padding_efficiency']:.3f}" if r["padding_efficiency"] is not None else "n/a"
        print(f"| {r['label']} | {r['samples_per_s']:.1f} | {r['runtime_s']:.2f} | {r['optimizer_steps']} | {eff} |")
    print(f"\nODB / Standard emitted samples/s: {odb['samples_per_s'] / standard['samples_per_s']:.2f}x "
          "(2 CPU ranks, gloo; all-rank samples / train wall-clock)")


if __name__ == "__main__":
    main()
