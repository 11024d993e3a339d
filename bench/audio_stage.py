"""Audio-stage balancing on generated speech workloads (synthetic): max/LB before and after,
clips and bytes moved, planning time.

``python -m bench.audio_stage [--quick] [--csv PATH]`` prints a markdown table and writes
``bench/results/audio_stage.csv``.

Workloads (synthetic, not measured data): every step, each rank holds ``samples`` samples;
a sample has 0-2 clips. Clip durations are lognormal, clipped to [0.3, 30] s, 100 valid mel
frames a second (Whisper's feature extractor):

* ``asr``: speech recognition, one clip a sample, median 8 s, sigma 0.6;
* ``spoken_qa``: one clip a sample, median 4 s, sigma 0.9 (short questions, long recordings);
* ``omni_mix``: 20% text-only, 50% one clip (``spoken_qa``), 30% two clips (``asr``).

Cost: valid frames (``QWEN25_OMNI_AUDIO``; docs/encoder_balancing.md says why this is right
for FlashAttention-2 and sdpa alike). LB = max(total / ranks, longest clip). Bytes: bf16,
128 mel bins a frame, embeddings of Qwen2.5-Omni-7B's width (3584) forward and their
gradients back. 8 ranks a node. Planning time = one ``plan_audio`` call (what every rank
runs per forward after the all-gather), median of the steps.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import numpy as np

from odb_factory.balance.audio_plan import plan_audio

FRAMES_PER_S = 100
MEL, HIDDEN, BYTES = 128, 3584, 2
RESULTS = Path(__file__).parent / "results"


def _durations(rng: np.random.Generator, n: int, median: float, sigma: float) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(median), sigma, n), 0.3, 30.0)


def _sample_clips(rng: np.random.Generator, workload: str) -> list[int]:
    if workload == "asr":
        seconds = _durations(rng, 1, 8.0, 0.6)
    elif workload == "spoken_qa":
        seconds = _durations(rng, 1, 4.0, 0.9)
    else:
        u = rng.random()
        seconds = ([] if u < 0.2 else _durations(rng, 1, 4.0, 0.9) if u < 0.7
                   else _durations(rng, 2, 8.0, 0.6))
    return [max(1, int(round(s * FRAMES_PER_S))) for s in seconds]


def step_frames(rng: np.random.Generator, workload: str, ranks: int, samples: int) -> list[list[int]]:
    """Every rank's clips (valid frames) for one step."""
    return [[f for _ in range(samples) for f in _sample_clips(rng, workload)] for _ in range(ranks)]


def measure(workload: str, ranks: int, samples: int, steps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    rows = {"before": [], "lpt": [], "min_move": [], "moved": [], "moved_mm": [], "bytes": [],
            "plan_ms": []}
    for _ in range(steps):
        frames = step_frames(rng, workload, ranks, samples)
        if not any(frames):
            continue
        t0 = time.perf_counter()
        plan = plan_audio(frames, ranks_per_node=8, frame_bytes=MEL * BYTES,
                          embed_row_bytes=HIDDEN * BYTES)
        rows["plan_ms"].append((time.perf_counter() - t0) * 1e3)
        fewest = plan_audio(frames, ranks_per_node=8, mode="min_move", frame_bytes=MEL * BYTES,
                            embed_row_bytes=HIDDEN * BYTES)
        clips = plan.num_items
        rows["before"].append(plan.max_over_lb_before)
        rows["lpt"].append(plan.max_over_lb_after)
        rows["min_move"].append(fewest.max_over_lb_after)
        rows["moved"].append(len(plan.moved_items) / clips)
        rows["moved_mm"].append(len(fewest.moved_items) / clips)
        rows["bytes"].append((plan.input_bytes_moved + 2 * plan.output_bytes_moved) / ranks)
    mean = statistics.fmean
    return {"workload": workload, "ranks": ranks, "samples_per_rank": samples,
            "steps": len(rows["before"]),
            "max_over_lb_before": round(mean(rows["before"]), 3),
            "max_over_lb_lpt": round(mean(rows["lpt"]), 3),
            "max_over_lb_min_move": round(mean(rows["min_move"]), 3),
            "clips_moved_lpt": round(mean(rows["moved"]), 3),
            "clips_moved_min_move": round(mean(rows["moved_mm"]), 3),
            "mb_moved_per_rank_lpt": round(mean(rows["bytes"]) / 1e6, 2),
            "plan_ms_median": round(statistics.median(rows["plan_ms"]), 3)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv", type=Path, default=RESULTS / "audio_stage.csv")
    args = parser.parse_args(argv)
    steps = 20 if args.quick else 100
    rows = [measure(w, ranks, samples, steps, seed=11)
            for w in ("asr", "spoken_qa", "omni_mix")
            for ranks, samples in ((8, 4), (8, 16), (64, 4), (64, 16))]
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("Audio stage, synthetic clips (bench/audio_stage.py): slowest rank's audio frames over "
          f"the lower bound, mean of {steps} steps\n")
    print("| workload | ranks x samples | before | LPT | min_move | clips moved (LPT / min_move) "
          "| MB moved per rank (LPT) | plan ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['ranks']} x {r['samples_per_rank']} | {r['max_over_lb_before']} "
              f"| {r['max_over_lb_lpt']} | {r['max_over_lb_min_move']} | {r['clips_moved_lpt']:.0%} / "
              f"{r['clips_moved_min_move']:.0%} | {r['mb_moved_per_rank_lpt']} | {r['plan_ms_median']} |")
    return rows


if __name__ == "__main__":
    main()
