"""The most any batching method can gain over Standard at batch 1 on this machine, model compute
alone: one optimizer step's k samples run forward and backward one at a time (Standard, batch 1
× accumulation k) against the same samples in one padding-free row (ODB's packed row: per-segment
attention, the weighted token loss), with no trainer, loader or collective around them.

    python -m bench.batching_ceiling [--repeats 3] [--vocab 151936] [--row-sets NAME,..]
                                     [--row-tokens N] [--supervised-share F]

`--row-tokens N --supervised-share F` makes the packed side what ODB's default runs on CPU: rows
of at most N tokens (`odb_token_budget: auto` is 1,024 there), logits at the supervised
positions only (the last F of each sample's tokens, a response after its prompt); Standard
still computes every position's logits, as LLaMA-Factory does.

The model is bench.cpu_layer's compute-dominated Qwen3 (hidden 256, 4 layers, intermediate 2048)
with a Qwen vocabulary (151,936 tokens, tied embeddings): its LM head and loss, linear in the
tokens, are most of a step's work, as they are for the small and mid-size Qwen models. Lengths
are synthetic: lognormal with the given mean and CV, cut at a cutoff_len. A packed row can only
save what a micro-batch costs beyond its tokens, so the ratio here bounds the real runs'
(bench.cpu_layer) from above.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import time
from typing import Callable, List, Optional

import torch

from .cpu_layer import LAYER_CONFIG
from .tables import md_table

# row set -> (label, mean tokens, length CV, cutoff_len)
ROW_SETS = {"short": ("short instruction rows (cut at 128)", 200, 0.8, 128),
            "cv1_mean100": ("CV 1, mean 100", 100, 1.0, 1024),
            "cv1_mean256": ("CV 1, mean 256", 256, 1.0, 1024),
            "cv1_mean300": ("CV 1, mean 300", 300, 1.0, 1024)}


def build_model(vocab: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from odb_factory.segment_attention import packed_attention
    config = Qwen3Config(vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=True, **LAYER_CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    packed_attention(model, "segments")  # packed rows attend per sample, as ODB's default does
    return model.train()


def lognormal_lengths(k: int, mean: float, cv: float, cutoff: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    sigma2 = math.log(1 + cv * cv)
    mu = math.log(mean) - sigma2 / 2
    return [max(8, min(cutoff, int(rng.lognormvariate(mu, math.sqrt(sigma2))))) for _ in range(k)]


def one_at_a_time(model: torch.nn.Module, lengths: List[int]) -> None:
    for length in lengths:
        ids = torch.randint(0, 1000, (1, length))
        (model(input_ids=ids, labels=ids).loss / len(lengths)).backward()


def rows_of(lengths: List[int], row_tokens: Optional[int]) -> List[List[int]]:
    """The samples in order, cut into rows of at most `row_tokens` (None: one row); a longer
    sample is a row of its own."""
    rows: List[List[int]] = [[]]
    for n in lengths:
        if rows[-1] and row_tokens is not None and sum(rows[-1]) + n > row_tokens:
            rows.append([])
        rows[-1].append(n)
    return rows


def packed(model: torch.nn.Module, lengths: List[int], row_tokens: Optional[int] = None,
           supervised_share: float = 1.0, every_logit: bool = False) -> None:
    """The step's samples as packed rows (per-segment attention, the weighted token loss); with
    `supervised_share` < 1 each sample's first tokens are an unsupervised prompt and the model
    computes the logits of the supervised positions only (`logits_to_keep`, as ODB does), or of
    every position with `every_logit` (the control of the test that both give one gradient)."""
    from odb_factory.loss import supervised_positions, weighted_token_sum
    weight = 1.0 / sum(lengths)
    for row in rows_of(lengths, row_tokens):
        total = sum(row)
        ids = torch.randint(0, 1000, (1, total))
        labels = ids.clone()
        for start, n in zip(itertools.accumulate([0, *row]), row):
            labels[0, start:start + n - max(1, round(n * supervised_share))] = -100
        kept = supervised_positions(labels) if supervised_share < 1 and not every_logit else None
        positions = torch.cat([torch.arange(n) for n in row]).unsqueeze(0)
        bounds = torch.tensor([0, *itertools.accumulate(row)], dtype=torch.int32)
        out = model(input_ids=ids, position_ids=positions, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds,
                    max_length_q=max(row), max_length_k=max(row), **({"logits_to_keep": kept} if kept is not None else {}))
        weighted_token_sum(out.logits.float(), labels, torch.full((1, total), weight), positions=kept).backward()


def median_seconds(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--samples-per-step", default="8,16", help="k values, comma-separated")
    parser.add_argument("--row-sets", default="short,cv1_mean100,cv1_mean300",
                        help=f"comma-separated, of {list(ROW_SETS)}")
    parser.add_argument("--row-tokens", type=int, default=None,
                        help="cut the packed side into rows of at most N tokens (default: one row a step)")
    parser.add_argument("--supervised-share", type=float, default=1.0,
                        help="the packed side computes the logits of this share of each sample's positions "
                             "(its last tokens) only, as ODB does; default 1: every position")
    args = parser.parse_args()
    torch.set_grad_enabled(True)
    model = build_model(args.vocab)
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    rows = []
    for name in args.row_sets.split(","):
        label, mean, cv, cutoff = ROW_SETS[name]
        for k in (int(x) for x in args.samples_per_step.split(",")):
            lengths = lognormal_lengths(k, mean, cv, cutoff, seed=k)
            alone = median_seconds(lambda: one_at_a_time(model, lengths), args.repeats)
            row = median_seconds(lambda: packed(model, lengths, args.row_tokens, args.supervised_share), args.repeats)
            model.zero_grad(set_to_none=True)
            rows.append({"rows (synthetic lengths)": label, "samples per step": k, "Σ tokens": sum(lengths),
                         "packed rows": len(rows_of(lengths, args.row_tokens)),
                         "one at a time, ms": round(alone * 1000, 1), "packed, ms": round(row * 1000, 1),
                         "ceiling × Standard": round(alone / row, 2)})
            print(rows[-1], flush=True)
    print(f"\nmodel: {parameters:.1f} M parameters (vocabulary {args.vocab}, tied), medians of {args.repeats}; "
          f"packed rows of at most {args.row_tokens or 'a step of'} tokens, logits of "
          f"{args.supervised_share:.0%} of their positions\n")
    print(md_table(rows, [(key, key) for key in rows[0]]))


if __name__ == "__main__":
    main()
