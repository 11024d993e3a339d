"""Every method's batches for one epoch, produced by the methods' real code paths.

A `Schedule` is what a method decides: for every micro-step, the sample indices each rank
trains (an empty batch is an IDLE slot), and how many micro-steps make one optimizer step.
It says nothing about time; `bench.simulate` turns it into seconds with a step model.

Methods (bench/README.md explains each and its knobs):
  standard          random order, DistributedSampler-style shards, fixed per-device batch
  standard_matched  the same with gradient accumulation so one optimizer step holds as many
                    tokens as ODB's
  sorted            one global length sort, dealt round-robin, fixed batch
  sorted_shuffled   the same batches in shuffled order (ranks of a step get unrelated lengths)
  group_by_length   transformers' LengthGroupedSampler indices, fixed batch, batches dealt to
                    ranks the way accelerate's BatchSamplerShard does
  gmt               global max-tokens (fairseq-style): sort all by the cached length, cut by
                    token budget, shuffle the batches, deal round-robin
  bmt               bucketed max-tokens: geometric length buckets (max/min = 2**0.25), shuffled
                    inside, batch per bucket = budget // bucket's longest, batches shuffled
  packing           text only: greedy knapsack to sum(len) <= budget (varlen attention)
  peer              online-dynamic-batching 0.1.2 `grouping_data` per rank and window
  odb / odb_nonjoin odb_factory.planning.simulate_epoch (join / non-join)
  odb_samples       ODB `step_mode="samples"`: a Standard schedule's optimizer steps, each
                    rank's share packed into token-budgeted micro-batches, counts aligned
  odb_balanced      ODB, then every step re-balanced across ranks with odb_factory.balance
  odb_balanced_2stage  the same plus the step's images re-balanced for the vision encoder
  odb_global        ODB with global grouping (`odb_global_grouping: true`): each round's groups
                    formed over every rank's samples, a step's groups of neighbouring cost
  odb_global_balanced  odb_global, then post-balanced as odb_balanced (+ encoder stage:
                    odb_global_balanced_2stage)
  odb_pf_global     both
  odb_pf            ODB with padding-free groups (`odb_padding_free: true`): budget on real
                    tokens, a group costs sum(len) and sum(len**2) (varlen attention)
  odb_pf_balanced   odb_pf, every step re-balanced with LPT on a*len + b*len**2 plus the
                    sample's vision work, as the loader's plan_step prices it (+ encoder stage on
                    multimodal workloads, the LLM cost alone: odb_pf_balanced_2stage)
  odb_pf_global_balanced  odb_pf_global, then post-balanced as odb_pf_balanced (+ _2stage)
  limit             not a schedule: odb_pf_global's work spread perfectly over the ranks of
                    every step (max = mean), with the same fixed costs (bench.lab.limit_result)
"""

from __future__ import annotations

import random
from typing import Callable, List, Optional, Sequence

import numpy as np

from odb_factory import ODBConfig, SampleCost
from odb_factory.planning.grouping import Budget
from odb_factory.planning.views import epoch_view
# Schedule and ODB's two schedule builders live in the package (`python -m odb_factory.dry_run`
# builds the same schedules); re-exported here.
from odb_factory.simulation.schedules import Schedule, costs_of, groups_schedule, samples_schedule  # noqa: F401
from odb_factory.simulation.schedules import index_array as _arr

from .workloads import Profile


def deal(batches: Sequence[Sequence[int]], world: int) -> List[List[np.ndarray]]:
    """Batch j goes to rank j % world in micro-step j // world; a short last step idles."""
    steps = []
    for start in range(0, len(batches), world):
        chunk = [_arr(b) for b in batches[start:start + world]]
        chunk += [_arr([]) for _ in range(world - len(chunk))]
        steps.append(chunk)
    return steps


def shard_batches(order: Sequence[int], world: int, batch: int) -> List[List[np.ndarray]]:
    """DistributedSampler without padding: rank r reads order[r::world] in chunks of `batch`;
    micro-step i holds every rank's i-th chunk (ranks whose shard ran out idle)."""
    shards = [list(order[r::world]) for r in range(world)]
    per_rank = [[shard[i:i + batch] for i in range(0, len(shard), batch)] for shard in shards]
    n = max(len(p) for p in per_rank)
    return [[_arr(per_rank[r][i]) if i < len(per_rank[r]) else _arr([]) for r in range(world)]
            for i in range(n)]


# ----------------------------------------------------------------------------- fixed batch
def standard(p: Profile, world: int, batch: int, seed: int = 0, accumulation: int = 1,
             name: str = "standard") -> Schedule:
    """Random order, fixed per-device batch. Smaller `batch` = OOM-safe for the long tail but
    more steps; `accumulation` > 1 trades optimizer steps for larger effective batches."""
    order = np.random.default_rng([seed, 11]).permutation(len(p))
    return Schedule(name, world, shard_batches(order.tolist(), world, batch), accumulation,
                    note=f"bs={batch}" + (f", GA={accumulation}" if accumulation > 1 else ""))


def sorted_by_length(p: Profile, world: int, batch: int) -> Schedule:
    """One global sort (longest first), dealt in order: neighbours in length share a step."""
    order = np.argsort(-p.tokens, kind="stable")
    return Schedule("sorted", world, shard_batches(order.tolist(), world, batch), note=f"bs={batch}")


def sorted_shuffled(p: Profile, world: int, batch: int, seed: int = 0) -> Schedule:
    """Sort by length, cut fixed batches, then shuffle the batch order (the usual guard against
    a length curriculum): batches are homogeneous, but a step's ranks get unrelated lengths."""
    order = np.argsort(-p.tokens, kind="stable").tolist()
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    random.Random(f"sorted:{seed}").shuffle(batches)
    return Schedule("sorted_shuffled", world, deal(batches, world), note=f"bs={batch}")


def group_by_length(p: Profile, world: int, batch: int, seed: int = 0) -> Schedule:
    """HF `group_by_length`: transformers' LengthGroupedSampler (megabatches of 50 batches,
    sorted inside), batched by `batch`, batch j to rank j % world (accelerate's sharding)."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    gen = torch.Generator().manual_seed(seed)
    sampler = LengthGroupedSampler(batch, lengths=p.tokens.tolist(), generator=gen)
    order = list(iter(sampler))
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    return Schedule("group_by_length", world, deal(batches, world), note=f"bs={batch}")


# ----------------------------------------------------------------------------- max-tokens
def _cached_lengths(p: Profile, cache: str) -> np.ndarray:
    if cache == "oracle":
        return p.tokens
    if cache == "text":
        return p.text_tokens
    raise ValueError(f"cache must be 'oracle' or 'text', got {cache!r}")


def max_tokens_cut(lengths: np.ndarray, budget: int, tiebreak: Optional[np.ndarray] = None) -> List[np.ndarray]:
    """Sort longest first and cut maximal runs with n * (run's longest) <= budget: each run
    takes max(1, budget // its head) samples. The same partition as odb_factory's greedy
    `form_groups` on the whole list (tested), in O(#batches) numpy slices."""
    keys = (np.arange(len(lengths)),) if tiebreak is None else (np.arange(len(lengths)), -tiebreak)
    order = np.lexsort(keys + (-lengths,))
    l = lengths[order]
    out, i = [], 0
    while i < len(order):
        k = max(1, budget // int(l[i]))
        out.append(order[i:i + k])
        i += k
    return out


def gmt(p: Profile, world: int, budget: int, seed: int = 0, cache: str = "oracle",
        shuffle: bool = True) -> Schedule:
    """Global max-tokens: sort every sample by its cached length, cut maximal runs whose
    padded cost n * max <= budget, shuffle the batches, deal round-robin. `cache="text"` uses
    a stale text-only cache (vision tokens not counted): the cut is then blind to the images.
    `shuffle=False` deals the batches in workload order (a step's ranks get neighbouring lengths)."""
    lengths = _cached_lengths(p, cache)
    batches = [b.tolist() for b in max_tokens_cut(lengths, budget, p.patches)]
    if shuffle:
        random.Random(f"gmt:{seed}").shuffle(batches)
    name = ("gmt" if cache == "oracle" else "gmt_textcache") + ("" if shuffle else "_ordered")
    return Schedule(name, world, deal(batches, world),
                    note=f"budget={budget}, {cache} cache" + ("" if shuffle else ", dealt in workload order"))


def bmt(p: Profile, world: int, budget: int, seed: int = 0, growth: float = 2 ** 0.25,
        cache: str = "oracle", shuffle: bool = True) -> Schedule:
    """Bucketed max-tokens: length buckets with a constant max/min ratio `growth` (smaller =
    less padding but more, smaller buckets), shuffled inside; each bucket's batch size =
    budget // its longest sample; all batches shuffled, dealt round-robin (`shuffle=False`:
    dealt in workload order, longest bucket first)."""
    lengths = _cached_lengths(p, cache)
    rng = np.random.default_rng([seed, 12])
    bucket = np.floor(np.log(lengths / lengths.min()) / np.log(growth)).astype(np.int64)
    batches: List[List[int]] = []
    for k in np.unique(bucket):
        part = np.flatnonzero(bucket == k)
        bs = max(1, budget // int(lengths[part].max()))
        part = rng.permutation(part)
        batches += [part[i:i + bs].tolist() for i in range(0, len(part), bs)]
    if shuffle:
        random.Random(f"bmt:{seed}").shuffle(batches)
    else:
        batches.reverse()
    name = ("bmt" if cache == "oracle" else "bmt_textcache") + ("" if shuffle else "_ordered")
    return Schedule(name, world, deal(batches, world),
                    note=f"budget={budget}, buckets x{growth:.2f}, {cache} cache"
                    + ("" if shuffle else ", dealt in workload order"))


def tune_text_cache_budget(p: Profile, world: int, budget: int, fits: Callable, builder=gmt,
                           seed: int = 0) -> tuple:
    """Largest budget <= `budget` at which a stale text-only cache never OOMs this epoch
    (what a user does by trial and error). Returns (budget, schedule)."""
    lo, hi, best = 1, budget, None
    while lo <= hi:
        mid = (lo + hi) // 2
        s = builder(p, world, mid, seed=seed, cache="text")
        ok = all(fits(int(len(b) * p.tokens[b].max()), int(p.patches[b].sum()))
                 for step in s.steps for b in step if len(b))
        if ok:
            best, lo = (mid, s), mid + 1
        else:
            hi = mid - 1
    return best if best is not None else (0, None)


# ----------------------------------------------------------------------------- packing
def packing(p: Profile, world: int, budget: int, seed: int = 0, shuffle: bool = True) -> Schedule:
    """Greedy knapsack (LLaMA-Factory `packing` style): repeatedly open a bin and keep adding
    the longest remaining sample that still fits, so sum(len) <= budget. Text only.
    `shuffle=False` deals the bins in workload order (sum of len**2, largest first)."""
    from .peers import knapsack_bins

    if not p.text_only:
        raise ValueError(f"packing is text-only (Qwen3-VL packing is unsupported); {p.name} has images")
    bins = knapsack_bins(p.tokens.tolist(), budget)
    if shuffle:
        random.Random(f"pack:{seed}").shuffle(bins)
    else:
        sq = p.tokens.astype(np.float64) ** 2
        bins.sort(key=lambda b: -float(sq[b].sum()))
    return Schedule("packing" + ("" if shuffle else "_ordered"), world, deal(bins, world), cost_mode="packed",
                    note=f"sum(len) <= {budget}" + ("" if shuffle else ", dealt in workload order"))


# ----------------------------------------------------------------------------- peer package
def peer(p: Profile, world: int, budget: int, buffer_size: int = 256, seed: int = 0) -> Optional[Schedule]:
    """The peer package's grouping (online-dynamic-batching 0.1.2, `odb.grouping.grouping_data`)
    as a comparator: one single-rank call (ddp_group=None) per window of `buffer_size` samples
    of each rank's shard (the same shards as ours), overflow recirculated. Its own cross-rank
    alignment needs a process group, so ranks are aligned per window by IDLE-padding to the
    largest group count, an upper bound on its step count. None if the package is absent."""
    try:
        import torch
        from odb.grouping import grouping_data
    except Exception:
        return None
    per_rank_windows = []
    for rank in range(world):
        view = epoch_view(len(p), world, rank, seed, 0, True)
        pending = [{"input_ids": torch.zeros(1).expand(1, int(p.tokens[i])),
                    "odb_n_patches": int(p.patches[i]), "_i": i} for i in view]
        windows = []
        while pending:
            window, pending = pending[:buffer_size], pending[buffer_size:]
            grouped, overflow, *_ = grouping_data([window], budget, None, is_finished=not pending)
            windows.append([[s["_i"] for s in g] for g in grouped])
            if overflow:
                pending = overflow + pending
        per_rank_windows.append(windows)
    steps: List[List[np.ndarray]] = []
    for w in range(max(len(x) for x in per_rank_windows)):
        groups = [x[w] if w < len(x) else [] for x in per_rank_windows]
        for i in range(max(len(g) for g in groups)):
            steps.append([_arr(g[i]) if i < len(g) else _arr([]) for g in groups])
    return Schedule("peer", world, steps, note=f"budget={budget}, window={buffer_size}")


# ----------------------------------------------------------------------------- ODB
def odb(p: Profile, world: int, budget: int, join: bool = True, buffer_size: int = 256,
        seed: int = 0, costs: Optional[List[SampleCost]] = None, cost_mode: str = "padded",
        name: Optional[str] = None, global_grouping: bool = False, ranks_per_node: int = 8) -> Schedule:
    """odb_factory's planner for a whole world (`simulate_epoch`, the loader's own code);
    cost_mode "packed": padding-free groups; global_grouping: each round's groups formed over
    every rank's samples."""
    cfg = ODBConfig(token_budget=budget, join=join, buffer_size=buffer_size, seed=seed, cost_mode=cost_mode,
                    global_grouping=global_grouping, ranks_per_node=ranks_per_node)
    return groups_schedule(costs or costs_of(p), cfg, world, name or ("odb" if join else "odb_nonjoin"))


def odb_samples(standard_schedule: Schedule, p: Profile, budget: int, cost_mode: str = "padded",
                global_grouping: bool = False, name: str = "odb_samples") -> Schedule:
    """ODB `step_mode="samples"` on a Standard schedule: the same optimizer steps with the same
    samples; each rank packs its share of a step with odb_factory's own `pack_step` and the
    ranks align their micro-batch counts with `align_step` (the planner thread's functions);
    optionally padding-free (cost_mode "packed") and globally grouped."""
    budget_ = Budget.from_config(ODBConfig(token_budget=budget, cost_mode=cost_mode))
    return samples_schedule(standard_schedule, costs_of(p), budget_, name=name, global_grouping=global_grouping,
                            ranks_per_node=8)


def post_balance(s: Schedule, p: Profile, token_cost: Callable, cap_tokens: int,
                 ranks_per_node: int = 8, encoder_stage: bool = False, mode: str = "padded",
                 vision_cost: Optional[Callable] = None) -> Schedule:
    """Re-balance every micro-step's samples across ranks with odb_factory.balance (padded
    mode: rank cost = count * g(longest), exact min-max under the memory cap in padded
    tokens), then keep the plan; the slowest rank still sets the step in the simulation.

    The LLM cost alone is balanced, so a rank that receives many short samples also receives
    their images. `encoder_stage=True` marks the schedule so the simulation also re-balances
    each step's images across ranks for the vision encoder on their own (OrchMLLM's
    per-stage balance: the vision stage and the LLM stage each wait for their slowest rank).
    mode "lpt" (padding-free schedules): rank cost = sum of token_cost(len) + vision_cost(patches)
    (a function of the sample's patch total, the only vision figure the loader's plan_step
    sees), LPT, uncapped, as the loader runs it for packed budgets."""
    from odb_factory.balance import balance

    steps, ratios = [], []
    for step in s.steps:
        lengths = [p.tokens[b].astype(np.float64) for b in step]
        if sum(len(b) for b in step) == 0:
            steps.append(step)
            continue
        costs = [token_cost(l) for l in lengths]
        if mode != "padded" and vision_cost is not None:
            costs = [c + np.where(p.patches[b] > 0, vision_cost(p.patches[b].astype(np.float64)), 0.0)
                     for c, b in zip(costs, step)]
        try:
            plan = balance(costs, ranks_per_node, mode, lengths_per_rank=lengths,
                           cost_model=token_cost if mode == "padded" else None,
                           token_budget=float(cap_tokens) if mode == "padded" else None)
        except ValueError:  # infeasible under the cap: the step runs as aligned (as the loader does)
            steps.append(step)
            continue
        steps.append([_arr([step[src][pos] for src, pos in dest]) for dest in plan.destinations])
        ratios.append(plan.max_over_lb)
    name = s.method + ("_balanced_2stage" if encoder_stage else "_balanced")
    cap = ", memory cap" if mode == "padded" else ""
    note = s.note + f", post-balanced ({mode}{cap})" + (" + encoder stage" if encoder_stage else "")
    return Schedule(name, s.world, steps, s.accumulation, s.cost_mode, s.expected_samples,
                    step_ends=s.step_ends, note=note,
                    extra={"max_over_lb": ratios, "encoder_balanced": encoder_stage})
