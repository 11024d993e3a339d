"""What one forward and backward of a packed row costs as the row grows, on ranks that run in
step as a training run's ranks do (one thread each, gloo, a barrier before every measurement),
model compute alone: the measurement behind `odb_token_budget: auto` on CPU.

    python -m bench.row_size [--sizes 256,512,1024,2048,3072,4096] [--ranks 2] [--repeats 3]
                             [--mean 256] [--supervised-share 0.8] [--vocab 151936]

Each size is one packed row of whole samples (synthetic lognormal lengths of the given mean, CV
1, cut at 1024) of at most that many tokens: per-segment attention, logits at the supervised
positions only (the last `--supervised-share` of each sample's tokens), ODB's weighted token
loss, on bench.cpu_layer's Qwen3 (bench.batching_ceiling.build_model). Every rank packs the
same row. Prints, per size, the median seconds on rank 0, the milliseconds a token, and rank
0's peak resident memory once that size has run (sizes run smallest first in the warm-up).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import List

import torch

from odb_factory.llamafactory.launch import _free_port

from .batching_ceiling import build_model, lognormal_lengths, packed
from .tables import md_table


def row_of(pool: List[int], tokens: int) -> List[int]:
    """Samples from `pool`, in order, that fit a row of at most `tokens` (a longer one is skipped)."""
    row: List[int] = []
    for n in pool:
        if sum(row) + n <= tokens:
            row.append(n)
    return row


def measure(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = build_model(args.vocab)
        pool = lognormal_lengths(400, args.mean, 1.0, 1024, seed=1)
        rows = {size: row_of(pool, size) for size in args.sizes}
        seconds = {size: [] for size in args.sizes}
        peak = {}
        for size in sorted(args.sizes):  # warm-up: the first call of each shape, smallest first
            packed(model, rows[size], None, args.supervised_share)
            model.zero_grad(set_to_none=True)
            peak[size] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB
        for _ in range(args.repeats):
            for size in args.sizes:
                dist.barrier()
                start = time.perf_counter()
                packed(model, rows[size], None, args.supervised_share)
                seconds[size].append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
        dist.barrier()
        if rank == 0:
            table = []
            for size in args.sizes:
                tokens, median = sum(rows[size]), statistics.median(seconds[size])
                table.append({"row of at most": size, "tokens": tokens, "samples": len(rows[size]),
                              "s, median": round(median, 3), "ms a token": round(median / tokens * 1000, 3),
                              "min, max s": f"{min(seconds[size]):.3f}, {max(seconds[size]):.3f}",
                              "rank's peak memory, GiB": round(peak[size], 1)})
            with open(out, "w") as f:
                f.write(md_table(table, [(k, k) for k in table[0]]) + "\n")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,512,1024,2048,3072,4096",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mean", type=float, default=256)
    parser.add_argument("--supervised-share", type=float, default=0.8)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args(argv)
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "table.md")
        mp.spawn(measure, args=(args.ranks, _free_port(), args, out), nprocs=args.ranks)
        with open(out) as f:
            table = f.read()
    print(f"{args.ranks} ranks in step, one thread each; rows of lognormal lengths (mean {args.mean:g}, "
          f"CV 1, synthetic), logits of {args.supervised_share:.0%} of their positions, vocabulary "
          f"{args.vocab}; medians of {args.repeats} after a warm-up\n")
    print(table)
    return table


if __name__ == "__main__":
    main()
