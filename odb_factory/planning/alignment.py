"""DGAP alignment: one target group count per round, and how a rank meets it.

Every rank publishes a RankStatus; `target_groups` is a pure function of all of them, so
every rank computes the same target T and emits exactly T slots this round. The protocol,
and why it terminates without deadlock or lost samples, is in docs/dgap.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

from .grouping import Budget, PlannedSample


class RankStatus(NamedTuple):
    groups: int       # groups the rank's buffer forms under the budget
    buffered: int     # samples in the rank's buffer
    exhausted: bool   # the rank's view has nothing left to pull


def target_groups(statuses: Sequence[RankStatus]) -> int:
    """T for this round; 0 means no rank holds data and the epoch is over.

    Output capacity of a rank: a rank that is still streaming can emit its `groups`
    without waste (splitting would shrink groups it could fill with new samples later); a
    rank whose view is exhausted can emit any number of slots up to `buffered` by
    splitting, since otherwise it would only idle. Hence:
      * while some rank streams: T = min over streaming ranks of `groups` (the minimum
        positive output capacity); bigger ranks overflow, drained ranks split;
      * once every rank with data is draining: T = max over them of `groups`, the fewest
        slots in which all remaining samples fit, and each rank splits or idles up to it.
    """
    active = [s for s in statuses if s.buffered > 0]
    if not active:
        return 0
    streaming = [s.groups for s in active if not s.exhausted]
    if streaming:
        return min(streaming)
    return max(s.groups for s in active)


@dataclass
class Fit:
    slots: List[List[PlannedSample]]   # exactly T entries; [] is an IDLE slot
    recirculated: List[PlannedSample]  # overflow: back into the buffer for the next round
    splits: int                        # singletons peeled off to reach T
    overflow_groups: int               # groups sent back


def fit_to_target(groups: Sequence[Sequence[PlannedSample]], target: int, budget: Budget,
                  shuffle_seed: Optional[str] = None) -> Fit:
    """Make exactly `target` slots out of this rank's `groups`.

    Overflow keeps the `target` fullest groups (the partial tail group goes back to be
    merged with new samples). Split peels singletons off the largest groups until the
    count is reached; if even all-singletons is short, the rest are IDLE slots.
    `shuffle_seed` permutes the kept slots so steps do not follow a length order.
    """
    groups = [list(g) for g in groups]
    recirculated: List[PlannedSample] = []
    overflow = 0
    splits = 0
    if len(groups) > target:  # pragma: no mutate, at == the kept groups are all, in order
        ranked = sorted(range(len(groups)), key=lambda i: (-budget.group_cost(groups[i]), i))
        keep = sorted(ranked[:target])
        dropped = sorted(ranked[target:])
        overflow = len(dropped)
        for i in dropped:
            recirculated.extend(groups[i])
        groups = [groups[i] for i in keep]
    while len(groups) < target:
        largest = max(range(len(groups)), key=lambda i: (len(groups[i]), -i), default=None)
        if largest is None or len(groups[largest]) <= 1:
            break
        groups.append([groups[largest].pop()])  # the shortest member leaves alone
        splits += 1
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(groups)
    slots = groups + [[] for _ in range(target - len(groups))]
    return Fit(slots, recirculated, splits, overflow)


def trim_to_quota(slot_sizes: Sequence[Sequence[int]], remaining: int) -> Tuple[List[List[int]], int]:
    """Non-join quota closure: how many samples of each (rank, slot) to keep so that the
    round adds exactly min(remaining, total) samples, counting slot by slot in rank order.

    Returns (kept[rank][slot], new_target): slots after the one that reaches the quota are
    dropped on every rank, so no rank runs an all-IDLE step at the end.
    """
    world = len(slot_sizes)
    target = len(slot_sizes[0]) if world else 0  # pragma: no mutate, no rank: no slot is read
    kept: List[List[int]] = [[] for _ in range(world)]
    last_used = -1
    for slot in range(target):
        for rank in range(world):
            take = min(slot_sizes[rank][slot], remaining)
            kept[rank].append(take)
            remaining -= take
            if take:
                last_used = slot
    new_target = last_used + 1
    return [row[:new_target] for row in kept], new_target
