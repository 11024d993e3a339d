"""Encoder-stage balancing inside the model (OrchMLLM's per-stage orchestration).

* ``vision``: ``VisionBalancer``, the mechanism around a vision tower (which rank encodes
  which image comes from the pure ``odb_factory.balance.vision_plan``; the differentiable
  exchange of rows from ``odb_factory.comm.row_exchange``).

The Qwen3-VL model patch is ``odb_factory_patches.transformers_qwen3_vl``. See
docs/encoder_balancing.md.
"""

from odb_factory.balance.vision_plan import VisionPlan, item_cost, item_costs, local_plan, plan_vision
from odb_factory.comm import ODBExchangeError, gather_objects
from odb_factory.comm.row_exchange import all_to_all_rows

from .vision import TowerDims, VisionBalancer, VisionStepStats

__all__ = [
    "ODBExchangeError", "TowerDims", "VisionBalancer", "VisionPlan", "VisionStepStats",
    "all_to_all_rows", "gather_objects", "item_cost", "item_costs", "local_plan",
    "plan_vision",
]
