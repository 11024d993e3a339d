"""What the vision and the audio balancer share: their options, the call counter that names
each exchange, and the bounded history of per-call figures."""

from __future__ import annotations

from typing import Any

from odb_factory.balance.cost_model import StageCostModel
from odb_factory.comm import group_rank_world
from odb_factory.comm.row_exchange import DEFAULT_TIMEOUT_S


class StageBalancer:
    """``group``: a process group whose backend has point-to-point ops (gloo: tensors are
    staged through CPU; NCCL: they stay on the GPU); ``None`` = the default group.
    ``enabled=False`` makes ``encode`` run the tower locally, with no communication.
    ``mode``, ``tolerance`` and ``placement`` go to ``odb_factory.balance.balance``."""

    default_cost_model: StageCostModel

    def __init__(self, group: Any | None = None, cost_model: StageCostModel | None = None, *,
                 ranks_per_node: int = 8, mode: str = "lpt", tolerance: float | None = None,
                 placement: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 enabled: bool = True):
        self.group = group
        self.cost_model = cost_model if cost_model is not None else self.default_cost_model
        self.ranks_per_node = ranks_per_node
        self.mode = mode
        self.tolerance = tolerance
        self.placement = placement
        self.timeout_s = timeout_s
        self.enabled = enabled
        self.step = 0            # balanced calls so far: names each exchange in errors
        self.last_stats: Any = None
        self.history: list = []  # the step stats of recent calls (bounded)
        self.max_history = 1000

    @property
    def rank_world(self) -> tuple[int, int]:
        return group_rank_world(self.group)

    def _record(self, stats: Any) -> None:
        # recorded before the embedding exchange, whose figures are filled in afterwards
        self.last_stats = stats
        self.history.append(stats)
        del self.history[:-self.max_history]
