"""Padding-free groups measured on this machine: Standard vs ODB `samples` with padded groups vs
ODB `samples` with padding-free groups (`odb_padding_free: true`), the same optimizer steps and
samples for all three, so the same model.

    python -m bench.padding_free [--repeats N] [--cells 1x4,1x16]

Real LLaMA-Factory runs (the torchrun command `llamafactory-cli train` starts) on 2 CPU ranks
(tiny Qwen3-VL, generated demo set, bench.measured's settings), the three modes alternating
inside every repeat; throughput is train samples over HF's `train_runtime`. On CPU, sdpa builds
a dense (Σ len)² block mask for a packed row, so this measures the CPU case, where padding-free
is not expected to pay; the GPU case (flash attention's varlen kernels) is simulated in
`make bench`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import List

from .measured import RUNS, STANDARD_RECIPE, train
from .step_modes import SAMPLES_RECIPE, _spread, markdown, train_samples

MODES = {"standard": (STANDARD_RECIPE, {}), "padded": (SAMPLES_RECIPE, {"odb_padding_free": False}),
         "padding_free": (SAMPLES_RECIPE, {"odb_padding_free": True, "odb_packed_attention": "mask"})}
LEDGER = RUNS / "padding_free.jsonl"


def measure(repeats: int, cells: List[tuple]) -> List[dict]:
    rows = []
    LEDGER.parent.mkdir(parents=True, exist_ok=True)
    with LEDGER.open("w") as ledger:
        for repeat in range(repeats):
            for bs, ga in cells:
                for mode, (recipe, extra) in MODES.items():
                    print(f"[padding-free] repeat {repeat + 1}/{repeats}: {mode}, batch {bs} × accumulation {ga}",
                          file=sys.stderr, flush=True)
                    m = train(f"pf_{mode}_bs{bs}_ga{ga}_r{repeat}", recipe, per_device_train_batch_size=bs,
                              gradient_accumulation_steps=ga, **extra)
                    row = {"mode": mode, "bs": bs, "ga": ga, "repeat": repeat, "train_runtime": m["train_runtime"],
                           "eval_loss": m.get("eval_loss"), "optimizer_steps": m["optimizer_steps"]}
                    ledger.write(json.dumps(row) + "\n")
                    rows.append(row)
    return rows


def table(rows: List[dict], samples: int) -> List[dict]:
    out = []
    for bs, ga in sorted({(r["bs"], r["ga"]) for r in rows}):
        by = {m: {r["repeat"]: r for r in rows if (r["bs"], r["ga"], r["mode"]) == (bs, ga, m)} for m in MODES}
        repeats = sorted(set.intersection(*(set(v) for v in by.values())))
        line = {"batch × accumulation": f"{bs} × {ga}", "repeats": len(repeats)}
        for mode in MODES:
            line[f"{mode} samples/s"] = _spread([samples / by[mode][k]["train_runtime"] for k in repeats])
        for mode in ("padded", "padding_free"):
            ratios = [by["standard"][k]["train_runtime"] / by[mode][k]["train_runtime"] for k in repeats]
            line[f"{mode} / Standard"] = f"{statistics.mean(ratios):.2f}× [{min(ratios):.2f}, {max(ratios):.2f}]"
        ratios = [by["padded"][k]["train_runtime"] / by["padding_free"][k]["train_runtime"] for k in repeats]
        line["padding_free / padded"] = f"{statistics.mean(ratios):.2f}× [{min(ratios):.2f}, {max(ratios):.2f}]"
        line["optimizer steps"] = " = ".join(str(by[m][repeats[0]]["optimizer_steps"]) for m in MODES)
        std_eval = by["standard"][repeats[0]]["eval_loss"]
        worst = max(abs(by[m][k]["eval_loss"] - std_eval) / std_eval for m in MODES for k in repeats)
        line["eval loss max rel. diff"] = f"{worst:.1e}"
        out.append(line)
    return out


def main(argv=None) -> List[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cells", default="1x4,1x16")
    args = parser.parse_args(argv)
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")]
    rows = measure(args.repeats, cells)
    lines = table(rows, train_samples())
    print(markdown(lines))
    return lines


if __name__ == "__main__":
    main()
