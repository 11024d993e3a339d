"""Deprecated (0.2.0; removed in 0.3.0): the encoder stage moved to `odb_factory.encoder_stage`
(the mechanism), `odb_factory.balance.vision_plan` (the pure plan) and `odb_factory.comm` (the
exchanges). The names of 0.1.0 are re-exported from there, with a DeprecationWarning on import."""

import warnings
from typing import Any, List, Optional

from odb_factory.balance.vision_plan import VisionPlan, item_cost, item_costs, local_plan, plan_vision
from odb_factory.comm import gather as _gather
from odb_factory.comm.errors import ODBExchangeError
from odb_factory.comm.row_exchange import DEFAULT_TIMEOUT_S, all_to_all_rows
from odb_factory.encoder_stage.vision import TowerDims, VisionBalancer, VisionStepStats

warnings.warn("odb_factory.orchestrate is deprecated (0.2.0; removed in 0.3.0): import VisionBalancer from "
              "odb_factory.encoder_stage, the plan from odb_factory.balance.vision_plan and the exchanges "
              "from odb_factory.comm", DeprecationWarning, stacklevel=2)


def gather_objects(obj: Any, group: Optional[Any], what: str, step: int = -1,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> List[Any]:
    """0.1.0's signature of `odb_factory.comm.gather.gather_objects`."""
    return _gather.gather_objects(obj, group, what, f"step {step}", timeout_s, error=ODBExchangeError)


__all__ = [
    "ODBExchangeError", "TowerDims", "VisionBalancer", "VisionPlan", "VisionStepStats",
    "all_to_all_rows", "gather_objects", "item_cost", "item_costs", "local_plan",
    "plan_vision",
]
