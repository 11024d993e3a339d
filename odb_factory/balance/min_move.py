"""Greedy rebalancing that starts from where the samples are and moves few bytes.

Each step looks at the most loaded rank r (ties: lowest id) and moves one sample off it:
  1. if some sample fits on another rank without pushing that rank above the target, prefer a
     sample that alone brings r down to the target, with the fewest bytes; otherwise the one
     with the most cost per byte. Destination: same node as the sample's source first, then
     least loaded, then lowest id.
  2. otherwise the move that most lowers max(load of r, load of the destination).
  3. if no move lowers it, stop: the target is reported as not met.
Every move replaces the maximum load by two strictly smaller loads, so the descending-sorted
load vector strictly decreases and no state repeats: the loop terminates (and is also capped
at MOVES_PER_SAMPLE * n moves), and the maximum load never increases (unless caps that the
starting placement violates force moves first). Minimum-bytes rebalancing contains knapsack,
so no byte-optimality is claimed.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from .caps import Caps, fits_on, infeasible_error
from .inputs import Samples

MOVES_PER_SAMPLE = 4


class _State:
    def __init__(self, s: Samples, caps: Caps, node: np.ndarray) -> None:
        self.s, self.caps, self.node = s, caps, node
        self.rank_of = s.src.copy()
        self.members: list[list[int]] = [[] for _ in range(s.num_ranks)]
        for i, r in enumerate(s.src.tolist()):
            self.members[r].append(i)
        self.loads = np.zeros(s.num_ranks)
        self.counts = np.zeros(s.num_ranks, dtype=np.int64)
        self.max_len = np.zeros(s.num_ranks)
        for r in range(s.num_ranks):
            self._refresh(r)

    def _refresh(self, r: int) -> None:
        idx = self.members[r]
        self.loads[r] = math.fsum(self.s.cost[idx].tolist())  # exact: no drift over moves
        self.counts[r] = len(idx)
        lengths = self.s.length
        self.max_len[r] = float(lengths[idx].max()) if idx and lengths is not None else 0.0

    def move(self, i: int, d: int) -> None:
        r = int(self.rank_of[i])
        self.members[r].remove(i)
        bisect.insort(self.members[d], i)
        self.rank_of[i] = d
        self._refresh(r)
        self._refresh(d)

    def accepts(self, idx: np.ndarray, r: int) -> np.ndarray:
        lengths = None if self.s.length is None else self.s.length[idx]
        ok = self.caps.accepts_many(self.counts, self.max_len, lengths)
        ok = np.broadcast_to(ok, (idx.shape[0], ok.shape[1])).copy()
        ok[:, r] = False
        return ok

    def violates(self, r: int) -> bool:
        c = self.caps
        return bool((c.max_samples is not None and self.counts[r] > c.max_samples) or
                    (c.token_budget is not None
                     and self.counts[r] * self.max_len[r] > c.token_budget))


def _destination(st: _State, i: int, allowed: np.ndarray, target: float) -> int:
    d = np.flatnonzero(allowed)
    over = st.loads[d] + st.s.cost[i] > target
    inter = st.node[d] != st.node[st.s.src[i]]
    return int(d[np.lexsort((d, st.loads[d], inter, over))[0]])


def _repair(st: _State, target: float) -> None:
    """Move samples off ranks that violate a cap in the starting placement."""
    s, caps = st.s, st.caps
    for r in range(s.num_ranks):
        while st.violates(r):
            idx = np.asarray(st.members[r])
            if caps.max_samples is not None and st.counts[r] > caps.max_samples:
                pick = np.lexsort((idx, s.size[idx]))  # fewest bytes first
            else:
                pick = np.lexsort((idx, s.size[idx], -s.length[idx]))  # longest first
            ok = st.accepts(idx, r)
            rows = [p for p in pick.tolist() if ok[p].any()]
            if not rows:
                lengths = None if s.length is None else np.sort(s.length)[::-1]
                if not fits_on(caps, lengths, s.n, s.num_ranks):
                    raise infeasible_error(caps, s.n, s.num_ranks)
                raise ValueError(f"min_move could not repair rank {r} under {caps.describe()}; "
                                 "use mode='lpt' or mode='padded'")
            i = int(idx[rows[0]])
            st.move(i, _destination(st, i, ok[rows[0]], target))


def _step(st: _State, r: int, target: float) -> tuple[int, int] | None:
    s = st.s
    load = st.loads[r]
    idx = np.asarray(st.members[r], dtype=np.int64)
    idx = idx[load - s.cost[idx] < load]  # only samples whose removal lowers the load
    if idx.shape[0] == 0:
        return None
    c, size = s.cost[idx], s.size[idx]
    ok = st.accepts(idx, r)
    fits = ok & (st.loads[None, :] + c[:, None] <= target)
    rows = np.flatnonzero(fits.any(axis=1))
    if rows.shape[0]:
        finisher = load - c[rows] <= target
        with np.errstate(divide="ignore"):
            ratio = np.where(size[rows] > 0, c[rows] / size[rows], np.inf)
        k1 = np.where(finisher, size[rows], -ratio)
        intra = (fits[rows] & (st.node[None, :] == st.node[s.src[idx[rows]]][:, None])).any(1)
        row = int(rows[np.lexsort((idx[rows], ~intra, k1, ~finisher))[0]])
        return int(idx[row]), _destination(st, int(idx[row]), fits[row], target)
    # No move stays within the target: take the one that lowers the pair maximum the most.
    new_dst = st.loads[None, :] + c[:, None]
    good = ok & (new_dst < load)
    rr, dd = np.nonzero(good)
    if rr.shape[0] == 0:
        return None
    pair_max = np.maximum(load - c[rr], new_dst[rr, dd])
    inter = st.node[dd] != st.node[s.src[idx[rr]]]
    k = np.lexsort((idx[rr], dd, st.loads[dd], inter, size[rr], pair_max))[0]
    return int(idx[rr[k]]), int(dd[k])


def min_move(s: Samples, caps: Caps, ranks_per_node: int, target: float) -> tuple[np.ndarray, bool]:
    """Destination rank of every sample and whether max load <= target was reached."""
    node = np.arange(s.num_ranks) // ranks_per_node
    st = _State(s, caps, node)
    if caps.active:
        _repair(st, target)
    for _ in range(MOVES_PER_SAMPLE * s.n):
        r = int(np.argmax(st.loads))
        if st.loads[r] <= target:
            break
        step = _step(st, r, target)
        if step is None:
            break
        st.move(*step)
    return st.rank_of, bool(st.loads.max() <= target)
