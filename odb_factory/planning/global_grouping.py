"""Global grouping: one round's groups formed over the union of every rank's samples.

Each rank forms its groups from its own window, so the ranks of one step hold unrelated
lengths and the step waits for the slowest. After alignment every rank knows every rank's
samples of the round (their costs are gathered anyway), so every rank can compute the same
new layout of the round's slots: the union sorted and cut into W groups per step of minimal
maximum cost within the budget, the W groups of one step taken from neighbouring runs (equal
cost, similar lengths), each group placed on the rank that already holds most of its bytes
(node-aware assignment, the post-balancing placement). The samples then move to the rank that
trains them before collation (loader/step_rebalancer.py).

The round keeps every sample (a permutation of the slots' contents) in the fewest T' <= T steps
whose T'*W groups hold them within the budget (a thin round, a rank's tail, needs fewer steps
than the alignment gave it): every rank computes the same T', so the alignment guarantees hold:
equal steps on every rank, join coverage, the non-join quota.
Pure and deterministic: every rank computes the same layout from the same gathered costs.
"""

from __future__ import annotations

import bisect
import heapq
import random
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..balance.caps import Caps
from ..balance.cost_model import QWEN3_VL_LLM, VISION_BY_PATCH_TOTAL, StageCostModel
from ..balance.padded import padded_groups
from ..balance.placement import place
from ..balance.step_plan import BYTES_PER_TOKEN, vision_cost
from ..cost import SampleCost
from .grouping import Budget, PlannedSample
from .rounds import Slot

Source = Tuple[int, int, int]          # (rank, slot, position) of a sample in the aligned round
Layout = List[List[List[Source]]]      # layout[rank][slot]: the sources of that slot's samples


def regroup_round(costs: Sequence[Sequence[Sequence[SampleCost]]], budget: Budget,
                  ranks_per_node: int = 1, cost_model: StageCostModel = QWEN3_VL_LLM,
                  seed: Optional[str] = None,
                  vision_cost_model: Optional[StageCostModel] = VISION_BY_PATCH_TOTAL) -> Optional[Layout]:
    """The round's new layout (T' <= T slots per rank, see `_step_counts`), or None when its
    samples do not fit T*W groups within the budget (the round then trains as aligned).

    costs[rank][slot]: the samples each rank trains in each slot of the aligned round (every
    rank has the same number of slots). Padded budgets: the exact min-max partition of the
    length-sorted union into contiguous runs (cost count * g(longest), capped at the budget);
    packed budgets: LPT on g(len) plus the sample's vision-encoder cost (`vision_cost_model` of
    its patches, in cost_model's unit; it runs where the sample trains) under the budget's token
    sum, or best fit where LPT strands a sample. Over-budget samples stay alone.
    seed: the steps of the round are shuffled with it (None: longest step first)."""
    world = len(costs)
    slots = len(costs[0]) if world else 0
    if any(len(rank) != slots for rank in costs):
        raise ValueError(f"regroup_round: ranks hold different slot counts {[len(r) for r in costs]}")
    sources = [(r, p, i) for r in range(world) for p in range(slots) for i in range(len(costs[r][p]))]
    if len(sources) < slots or not sources:
        return None  # fewer samples than steps: alignment never plans that
    samples = [costs[r][p][i] for r, p, i in sources]
    tokens = np.array([budget.padded_length(c.input_tokens) if budget.cost_mode == "padded"
                       else c.input_tokens for c in samples], dtype=np.float64)
    vision = np.array([vision_cost(c, vision_cost_model) for c in samples], dtype=np.float64)
    alone = [k for k in range(len(samples)) if tokens[k] > budget.token_budget]
    rest = np.array([k for k in range(len(samples)) if tokens[k] <= budget.token_budget], dtype=np.int64)
    for steps in _step_counts(rest, tokens, len(alone), world, slots, budget):
        bins = world * steps - len(alone)
        if bins < (1 if rest.size else 0):
            continue
        if budget.cost_mode == "padded":
            groups = _padded(rest, tokens, bins, budget, cost_model)
        else:
            head_start = _beside_alone(alone, tokens, vision, world, bins, cost_model)
            groups = _packed(rest, tokens, vision, bins, budget, cost_model, head_start)
        if groups is None:
            continue
        groups = [[k] for k in alone] + groups
        if budget.has_encoder_caps and not all(
                budget.fits([PlannedSample(k, 0, samples[k]) for k in g]) for g in groups if len(g) > 1):
            continue  # the vision-patch or audio-frame cap rules this partition out
        return _layout(groups, samples, tokens, sources, world, steps, ranks_per_node, cost_model, seed,
                       padded=budget.cost_mode == "padded")
    return None


def _step_counts(rest: np.ndarray, tokens: np.ndarray, alone: int, world: int, slots: int,
                 budget: Budget) -> range:
    """Step counts to try, fewest first, from the fewest whose W groups could hold the round
    within the budget up to its T: a step saved is a micro-batch's fixed cost saved on every
    rank. Packed groups: the round's tokens over the budget. Padded groups: the runs of the
    longest-first cut at the budget (each run as many samples as fit beside its longest), the
    fewest groups any partition needs."""
    if not rest.size:
        need = 0
    elif budget.cost_mode == "packed":
        need = int(np.ceil(tokens[rest].sum() / budget.token_budget))
    else:
        longest_first = np.sort(tokens[rest])[::-1]
        need, at = 0, 0
        while at < longest_first.size:
            at += max(1, int(budget.token_budget // longest_first[at]))
            need += 1
    return range(min(slots, max(1, -(-(need + alone) // world))), slots + 1)


def _padded(rest: np.ndarray, tokens: np.ndarray, bins: int, budget: Budget,
            cost_model: StageCostModel) -> Optional[List[List[int]]]:
    lengths = tokens[rest]
    unit = np.asarray(cost_model(lengths), dtype=np.float64)
    try:
        local = padded_groups(unit, bins, Caps(token_budget=float(budget.token_budget)), lengths)
    except ValueError:  # T*W groups cannot hold the round within the budget
        return None
    return [rest[g].tolist() for g in local]


def _beside_alone(alone: Sequence[int], tokens: np.ndarray, vision: np.ndarray, world: int, bins: int,
                  cost_model: StageCostModel) -> List[float]:
    """Initial LPT loads: the groups that will share a step with over-budget samples (the
    costliest groups, dealt W per step) start at minus the costliest of them, so LPT fills them
    up to it first; the step waits for that sample anyway. In a thin round (a rank's tail) this
    keeps the other steps' ranks from idling beside it."""
    cost = sorted((float(cost_model(tokens[k])) + float(vision[k]) for k in alone), reverse=True)
    loads: List[float] = []
    for first in range(0, len(cost), world):
        loads += [-cost[first]] * (world - len(cost[first:first + world]))
    return (loads + [0.0] * bins)[:bins]


def _packed(rest: np.ndarray, tokens: np.ndarray, vision: np.ndarray, bins: int, budget: Budget,
            cost_model: StageCostModel, head_start: Optional[Sequence[float]] = None) -> Optional[List[List[int]]]:
    """LPT on cost (costliest first onto the least-loaded group with room for its tokens; groups
    start at `head_start`, default 0); where that strands a sample, best-fit decreasing on
    tokens, which fills groups tighter: near the fewest step count every group is almost full,
    so their costs are close anyway."""
    return (_lpt(rest, tokens, vision, bins, budget, cost_model, head_start)
            or _best_fit(rest, tokens, bins, budget))


def _best_fit(rest: np.ndarray, tokens: np.ndarray, bins: int, budget: Budget) -> Optional[List[List[int]]]:
    """Longest first into the fullest group it fits (the fewest groups a greedy packing needs)."""
    room = [float(budget.token_budget)] * bins   # kept sorted ascending beside `order`
    order = list(range(bins))
    groups: List[List[int]] = [[] for _ in range(bins)]
    for sample in rest[np.argsort(-tokens[rest], kind="stable")].tolist():
        size = float(tokens[sample])
        at = bisect.bisect_left(room, size)
        if at == bins:
            return None
        b = order.pop(at)
        left = room.pop(at) - size
        groups[b].append(sample)
        where = bisect.bisect_left(room, left)
        room.insert(where, left)
        order.insert(where, b)
    return groups


def _lpt(rest: np.ndarray, tokens: np.ndarray, vision: np.ndarray, bins: int, budget: Budget,
         cost_model: StageCostModel, head_start: Optional[Sequence[float]] = None) -> Optional[List[List[int]]]:
    cost = np.asarray(cost_model(tokens[rest]), dtype=np.float64) + vision[rest]
    order = np.argsort(-cost, kind="stable")
    heap = [(float(head_start[b]) if head_start else 0.0, b) for b in range(bins)]
    heapq.heapify(heap)
    room = [float(budget.token_budget)] * bins
    groups: List[List[int]] = [[] for _ in range(bins)]
    # plain Python floats and ints in the loop: numpy scalars cost more than the heap
    for sample, size, c in zip(rest[order].tolist(), tokens[rest[order]].tolist(), cost[order].tolist()):
        skipped = []
        while heap and room[heap[0][1]] < size:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, b = heapq.heappop(heap)
        groups[b].append(sample)
        room[b] -= size
        heapq.heappush(heap, (load + c, b))
        for item in skipped:
            heapq.heappush(heap, item)
    return groups


def _layout(groups: List[List[int]], samples: Sequence[SampleCost], tokens: np.ndarray,
            sources: Sequence[Source], world: int, slots: int, ranks_per_node: int,
            cost_model: StageCostModel, seed: Optional[str], padded: bool) -> Layout:
    """Steps of W groups of neighbouring LLM cost; each step's groups placed on ranks. Packed
    groups leave LPT with about equal costs, vision included; they differ in how much of it is
    vision, and neighbours by LLM cost share the same mix, so an error in the vision estimate
    moves a step's groups together."""
    def group_cost(g: List[int]) -> float:
        if not g:
            return 0.0
        if padded:  # what a padding collator computes: every row as long as the longest
            return len(g) * float(cost_model(float(tokens[g].max())))
        return float(np.sum(cost_model(tokens[g])))
    groups = sorted((g for g in groups if g), key=lambda g: (-group_cost(g), g))
    # Every step trains something: split the largest group. The fewest steps leave at least as
    # many groups as steps; only a step count raised by an encoder cap could leave fewer.
    while len(groups) < slots:  # pragma: no mutate
        largest = max(range(len(groups)), key=lambda k: len(groups[k]))
        g = groups.pop(largest)
        half = len(g) // 2
        groups = sorted(groups + [g[:half], g[half:]], key=lambda g: (-group_cost(g), g))
    steps = []
    for s in range(slots):  # neighbouring groups, keeping at least one for each later step
        take = min(world, len(groups) - (slots - s - 1))
        steps.append(groups[:take] + [[] for _ in range(world - take)])
        groups = groups[take:]
    if seed is not None:
        random.Random(seed).shuffle(steps)
    src_rank = np.array([s[0] for s in sources], dtype=np.int64)
    size = np.array([c.input_tokens * BYTES_PER_TOKEN for c in samples], dtype=np.float64)
    layout: Layout = [[[] for _ in range(slots)] for _ in range(world)]
    for slot, step in enumerate(steps):
        rank_of = place(step, src_rank, size, world, ranks_per_node, "assignment")
        for g, members in enumerate(step):
            layout[int(rank_of[g])][slot] = [sources[k] for k in members]
    return layout


def apply_layout(layout: Layout, slots_per_rank: Sequence[Sequence[Sequence]]) -> List[List[List]]:
    """What the layout puts in each (rank, slot): any per-sample items, moved."""
    return [[[slots_per_rank[r][p][i] for r, p, i in slot] for slot in rank] for rank in layout]


def regroup_slots(slots: Sequence[Sequence[Slot]], budget: Budget, ranks_per_node: int,
                  seed: Optional[str]) -> List[List[Slot]]:
    """One aligned round of a whole world (slots[rank][slot]) re-laid out in one process, as
    every rank's loader does with its exchange: the simulation's and the tests' path."""
    costs = [[[s.cost for s in slot.samples] for slot in rank] for rank in slots]
    layout = regroup_round(costs, budget, ranks_per_node, seed=seed)
    if layout is None:
        return [list(rank) for rank in slots]
    samples = apply_layout(layout, [[slot.samples for slot in rank] for rank in slots])
    out = []
    for rank, rank_slots in zip(samples, slots):
        row = []
        for q, (members, old) in enumerate(zip(rank, rank_slots)):
            step = [m for r in samples for m in r[q]]
            row.append(Slot(tuple(members), old.round, old.position, sum(m.cost.label_tokens for m in step),
                            len(step), budget.group_cost(members)))
        out.append(row)
    return out
