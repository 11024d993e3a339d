"""Which dataset indices each rank owns in an epoch, and the order it reads them.

Views are a pure function of (dataset size, world, rank, seed, epoch): a seeded global
permutation dealt round-robin, without the padding torch's DistributedSampler adds, so
shards may differ by one sample and no index is duplicated.
"""

from __future__ import annotations

import itertools
import random
from typing import Iterator, List


def epoch_view(num_samples: int, world_size: int, rank: int, seed: int, epoch: int,
               shuffle: bool = True) -> List[int]:
    order = list(range(num_samples))
    if shuffle:
        random.Random(f"odb-view:{seed}:{epoch}").shuffle(order)
    return order[rank::world_size]


def cycling_view(view: List[int], seed: int, epoch: int, rank: int) -> Iterator[int]:
    """Non-join stream: the view, then reshuffled repeats of it, forever (empty if the view is)."""
    if not view:
        return iter(())
    def cycles():
        yield from view
        for cycle in itertools.count(1):  # pragma: no mutate, the cycle number only labels a seed
            again = list(view)
            random.Random(f"odb-cycle:{seed}:{epoch}:{rank}:{cycle}").shuffle(again)
            yield from again
    return cycles()
