"""Stage orchestration inside the model (OrchMLLM's "global orchestrator", vision stage).

* ``exchange``: differentiable variable-size all-to-all of tensor rows (gloo: isend/irecv);
* ``vision_plan``: pure planning of which rank encodes which image, and the way back;
* ``vision_balance``: ``VisionBalancer``, the mechanism around a vision tower.

The Qwen3-VL model patch is ``odb_factory_patches.transformers_qwen3_vl``. See
docs/encoder_balancing.md.
"""

from .exchange import ODBExchangeError, all_to_all_rows, gather_objects
from .vision_balance import TowerDims, VisionBalancer, VisionStepStats
from .vision_plan import VisionPlan, item_cost, item_costs, local_plan, plan_vision

__all__ = [
    "ODBExchangeError", "TowerDims", "VisionBalancer", "VisionPlan", "VisionStepStats",
    "all_to_all_rows", "gather_objects", "item_cost", "item_costs", "local_plan",
    "plan_vision",
]
