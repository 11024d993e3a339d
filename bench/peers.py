"""The strongest padding-free peers of the field, and a lower bound that belongs to no method.

Peers (every one padding-free under the same L_max, ledger-checked like every method):

  verl               verl's dynamic batch size as verl ships it: per global batch, Karmarkar-Karp
                     on verl's own workload (24576 l + l^2) with equal sample counts across the
                     DP ranks (`get_seqlen_balanced_partitions(..., equal_size=True)`, as its
                     trainer's `_balance_batch` calls it), then `rearrange_micro_batches` per
                     rank with the micro-batch count agreed across ranks (MAX, as its
                     `dp_group` sync does). One optimizer step per global batch.
  verl_windows       the same, global batches cut from length-sorted windows of `WINDOW_BATCHES`
                     global batches (each batch holds neighbouring lengths).
  window_pack        the information ODB has: windows of world x B samples packed padding-free
                     under L_max (greedy knapsack), the bins sorted by workload and dealt
                     `world` per step, each step's samples re-split across the ranks by verl's
                     Karmarkar-Karp on the step model's per-sample cost (kept as dealt where a
                     re-split rank would not fit memory).
  epoch_pack         the same over the whole epoch: the exact length cache LLaMA-Factory's
                     preprocessed dataset holds unless `streaming: true` (+ `_2stage`: the
                     vision encoder balanced on its own, as ODB's `_2stage` variants are).

verl's functions come from the installed package (bench.balance_bench.load_verl); without it
the two verl peers are absent and the report says so.

`lower_bound` is what no schedule of the epoch can beat: every sample's padding-free cost spread
perfectly over the ranks, plus the per-micro-step and per-optimizer-step fixed costs at the
fewest micro-steps that L_max (or the memory cap) allows, one optimizer step each.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from odb_factory.simulation.schedules import Schedule
from odb_factory.simulation.schedules import index_array as _arr

from .workloads import Profile

WINDOW_BATCHES = 16          # verl_windows: global batches per length-sorted window


# ----------------------------------------------------------------------------- verl
_VERL = None


def verl_module():
    """verl's seqlen_balancing module (loaded once) or None; the reason it is absent, if so."""
    global _VERL
    if _VERL is None:
        from .balance_bench import load_verl
        mod, why = load_verl()
        if mod is not None:
            # rearrange_micro_batches ends by slicing a TensorDict per micro-batch; the
            # index lists it returns beside them are all a schedule needs.
            mod.tu.index_select_tensor_dict = lambda batch, idx: idx
        _VERL = (mod, why)
    return _VERL


def _verl_micro_batches(verl, lengths: np.ndarray, max_token_len: int, min_count: Optional[int]) -> List[List[int]]:
    """verl's `rearrange_micro_batches` on one rank's share (positions into `lengths`)."""
    import torch

    l = torch.as_tensor(lengths, dtype=torch.long)
    width = int(l.max())
    mask = (torch.arange(width)[None, :] < l[:, None]).long()
    batch = {"input_ids": torch.zeros(mask.shape, dtype=torch.long), "attention_mask": mask}
    _, idx = verl.rearrange_micro_batches(batch, max_token_len, min_num_micro_batch=min_count)
    return [list(map(int, part)) for part in idx]


def _verl_step(verl, p: Profile, batch: np.ndarray, world: int, budget: int) -> List[List[np.ndarray]]:
    """One global batch through verl: KK across ranks (equal counts), micro-batches per rank,
    the count agreed across ranks. Returns steps[micro][rank]."""
    lengths = p.tokens[batch].astype(np.int64)
    workload = verl.calculate_workload(np.asarray(lengths)).tolist()
    # verl's trainer drops an incomplete last global batch; here it is balanced without
    # equal counts so that the ledger stays whole.
    equal = len(batch) % world == 0 and len(batch) >= world
    if len(batch) >= world:
        parts = verl.get_seqlen_balanced_partitions(workload, world, equal_size=equal)
    else:
        parts = [[i] for i in range(len(batch))] + [[] for _ in range(world - len(batch))]
    count, per_rank = None, None
    while True:
        per_rank = [_verl_micro_batches(verl, lengths[part], budget, None if count is None else min(count, len(part)))
                    if part else [] for part in parts]
        agreed = max(len(x) for x in per_rank)
        if all(len(x) == agreed or len(x) == len(part) for x, part in zip(per_rank, parts)):
            break
        count = agreed
    steps = []
    for j in range(agreed):
        steps.append([_arr(batch[np.asarray(part)[x[j]]]) if j < len(x) else _arr([])
                      for x, part in zip(per_rank, parts)])
    return steps


def _global_batches(p: Profile, global_batch: int, seed: int, sorted_windows: bool) -> List[np.ndarray]:
    order = np.random.default_rng([seed, 31]).permutation(len(p))
    if not sorted_windows:
        return [order[i:i + global_batch] for i in range(0, len(order), global_batch)]
    out: List[np.ndarray] = []
    span = global_batch * WINDOW_BATCHES
    for start in range(0, len(order), span):
        window = order[start:start + span]
        window = window[np.argsort(-p.tokens[window], kind="stable")]
        batches = [window[i:i + global_batch] for i in range(0, len(window), global_batch)]
        random.Random(f"verl-windows:{seed}:{start}").shuffle(batches)
        out += batches
    return out


def verl_dynamic(p: Profile, world: int, budget: int, global_batch: int, seed: int = 0,
                 sorted_windows: bool = False) -> Optional[Schedule]:
    """verl's dynamic batch size (see the module docstring); None without verl. verl refuses a
    sample longer than `max_token_len`, so that is L_max or the longest sample, if longer."""
    verl, _ = verl_module()
    if verl is None:
        return None
    max_token_len = max(budget, int(p.tokens.max()))
    steps: List[List[np.ndarray]] = []
    ends: List[int] = []
    for batch in _global_batches(p, global_batch, seed, sorted_windows):
        steps += _verl_step(verl, p, batch, world, max_token_len)
        ends.append(len(steps) - 1)
    name = "verl_windows" if sorted_windows else "verl"
    note = f"global batch {global_batch}, max_token_len {max_token_len}" + (
        f", length-sorted windows of {WINDOW_BATCHES} batches" if sorted_windows else "")
    return Schedule(name, world, steps, cost_mode="packed", step_ends=ends, note=note)


# ----------------------------------------------------------------------------- packers
def knapsack_bins(lengths: Sequence[int], budget: int) -> List[List[int]]:
    """Greedy knapsack: open a bin, keep adding the longest remaining item that still fits
    (sum <= budget); an item longer than the budget goes alone. Positions into `lengths`."""
    pool = sorted((int(l), i) for i, l in enumerate(lengths))
    keys = [l for l, _ in pool]
    bins: List[List[int]] = []
    while pool:
        room, current = budget, []
        while pool:
            k = bisect.bisect_right(keys, room) - 1
            if k < 0:
                break
            l, i = pool.pop(k)
            keys.pop(k)
            current.append(i)
            room -= l
        if not current:
            _, i = pool.pop()
            keys.pop()
            current = [i]
        bins.append(current)
    return bins


def _kk(costs: np.ndarray, world: int) -> Optional[List[List[int]]]:
    from .balance_bench import kk_partition

    verl, _ = verl_module()
    if verl is None or len(costs) < world:
        return None
    return kk_partition(verl, costs, world, equal=False)


def window_pack(p: Profile, world: int, budget: int, window: int, cost: Callable[[np.ndarray], np.ndarray],
                fits: Callable, seed: int = 0, name: str = "window_pack") -> Schedule:
    """Windows of `window` samples packed padding-free under `budget`, bins dealt `world` per
    step in workload order, each step re-split across ranks by Karmarkar-Karp on `cost`
    (per-sample seconds) where every rank's share fits memory (`fits(tokens, patches)`)."""
    order = np.random.default_rng([seed, 32]).permutation(len(p))
    sample_cost = cost(np.arange(len(p)))
    steps: List[List[np.ndarray]] = []
    resplit = kept = 0
    for start in range(0, len(order), window):
        ids = order[start:start + window]
        bins = [ids[np.asarray(b)] for b in knapsack_bins(p.tokens[ids].tolist(), budget)]
        bins.sort(key=lambda b: -float(sample_cost[b].sum()))
        for k in range(0, len(bins), world):
            dealt = bins[k:k + world]
            dealt += [_arr([]) for _ in range(world - len(dealt))]
            members = np.concatenate(dealt)
            parts = _kk(sample_cost[members], world)
            if parts is not None:
                split = [members[np.asarray(x, dtype=np.int64)] for x in parts]
                if all(bool(fits(int(p.tokens[x].sum()), int(p.patches[x].sum()))) for x in split if len(x)):
                    steps.append([_arr(x) for x in split])
                    resplit += 1
                    continue
            steps.append([_arr(b) for b in dealt])
            kept += 1
    scope = "whole epoch (length cache)" if window >= len(p) else f"windows of {window}"
    return Schedule(name, world, steps, cost_mode="packed",
                    note=f"{scope}, sum(len) <= {budget}, KK re-split {resplit}/{resplit + kept} steps",
                    extra={"resplit_steps": resplit})


def sample_seconds_of(p: Profile, m) -> Callable[[np.ndarray], np.ndarray]:
    """Per-sample cost without the per-batch constant: LLM a*l + b*l^2 plus its vision work."""
    def cost(ids: np.ndarray) -> np.ndarray:
        return m.token_cost(p.tokens[ids]) + m.vision_seconds(p.images[ids], p.patches[ids], p.patch_sq[ids])
    return cost


# ----------------------------------------------------------------------------- the bound
@dataclass
class Bound:
    name: str
    micro_steps: int
    time_s: float
    samples_per_s: float
    note: str


def lower_bound(p: Profile, m, world: int, tokens_per_micro_batch: int, name: str) -> Bound:
    """No schedule of this epoch on `world` ranks is faster: every sample's padding-free cost
    (a l + b l^2 + its vision work) spread perfectly, plus c0 and the collectives of the
    fewest micro-steps that hold every token at `tokens_per_micro_batch` per rank, each an
    optimizer step (the token-budgeted methods here take one per micro-step; verl takes one per
    global batch, whose size is set to give no fewer)."""
    work = float(sample_seconds_of(p, m)(np.arange(len(p))).sum()) / world
    micro = max(1, math.ceil(float(p.tokens.sum()) / (world * tokens_per_micro_batch)))
    fixed = micro * (m.c0 + m.comm_micro_s + m.comm_opt_s + m.optimizer_s)
    time_s = work + fixed
    return Bound(name, micro, time_s, len(p) / time_s,
                 f"{micro} micro-steps of {tokens_per_micro_batch} tokens per rank")


# ----------------------------------------------------------------------------- exchanges
PIXEL_BYTES_PER_PATCH = 2 * 3 * 16 * 16 * 4   # Qwen3-VL: 2 frames x RGB x 16 x 16, float32
BYTES_PER_TOKEN_MOVED = 2 * 8                 # input id and label, int64
MERGED_PATCHES = 4                            # 2 x 2 patches -> one LLM token


def exchange_seconds(p: Profile, hidden: int, busbw: float, world: int) -> dict:
    """Upper bounds (seconds per rank over the epoch) of the exchanges the pricing leaves out,
    as if every sample changed rank once and the exchange never overlapped training:
    'samples' (global grouping, post-balancing: token ids, labels, pixel values) and
    'embeddings' (the encoder stage: each image's merged embeddings, bf16, there and back)."""
    samples = float(p.tokens.sum()) * BYTES_PER_TOKEN_MOVED + float(p.patches.sum()) * PIXEL_BYTES_PER_PATCH
    embeddings = 2 * float(p.patches.sum()) / MERGED_PATCHES * hidden * 2
    return {"samples": samples / world / busbw, "embeddings": embeddings / world / busbw}
