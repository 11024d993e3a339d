"""A step model measured on the machine that trains, instead of derived from a GPU's specs.

`python -m bench.cpu_layer --fit-out PATH` fits the step model's form (a fixed cost per
micro-batch, a cost per token, per token² of attention as the run computes it, and per position
whose logits are computed) to the optimizer steps of real runs, on each step's relative error,
and writes the coefficients as JSON; `python -m odb_factory.dry_run RECIPE --step-model PATH`
prices a recipe's batches with them. The runs' ranks share one machine, so the coefficients hold
for that many ranks only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict

from .step_model import StepModel

# JSON key -> StepModel field; seconds per unit, per rank
COEFFICIENTS = {"c0_s_per_micro_batch": "c0", "a_s_per_token": "a", "b_s_per_token_sq": "b",
                "head_s_per_logit_position": "head"}
DEVICES = ("cpu", "gpu")
RANKS_MEET = ("micro_step", "optimizer_step")  # StepModel.ranks_meet


def load(path: Path) -> Dict[str, Any]:
    """The measured model's JSON, checked: every coefficient a finite number >= 0, the ranks a
    positive integer, the device one of DEVICES, where the ranks wait for each other one of
    RANKS_MEET. Errors name the file and the key."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"step model {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"step model {path}: expected a JSON object")
    for key in (*COEFFICIENTS, "ranks", "device", "ranks_meet"):
        if key not in data:
            raise ValueError(f"step model {path}: missing {key!r} (write it with python -m bench.cpu_layer --fit-out)")
    for key in COEFFICIENTS:
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"step model {path}: {key} must be a finite number >= 0, got {value!r}")
    ranks = data["ranks"]
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"step model {path}: ranks must be a positive integer, got {ranks!r}")
    if data["device"] not in DEVICES:
        raise ValueError(f"step model {path}: device must be one of {list(DEVICES)}, got {data['device']!r}")
    if data["ranks_meet"] not in RANKS_MEET:
        raise ValueError(f"step model {path}: ranks_meet must be one of {list(RANKS_MEET)}, got {data['ranks_meet']!r}")
    return data


def measured_step_model(path: Path, world: int) -> StepModel:
    """The StepModel of a measured model's JSON (`load`), for `world` ranks: the ranks it was
    measured with, since ranks that share a machine slow each other. Memory is not modelled
    (never out of memory), nor collectives and the optimizer's update apart from the per
    micro-batch cost: they are the same for every batching of the same optimizer steps."""
    data = load(path)
    if world != data["ranks"]:
        raise ValueError(f"step model {path} was measured with {data['ranks']} ranks; pricing {world} ranks with "
                         f"it would price another machine: measure those ranks, or plan for {data['ranks']}")
    coefficients = {field: float(data[key]) for key, field in COEFFICIENTS.items()}
    return StepModel(name=f"measured ({Path(path).name})", world=world, ranks_per_node=world,
                     v0=0.0, va=0.0, vb=0.0, idle_s=coefficients["c0"], comm_micro_s=0.0, comm_opt_s=0.0,
                     optimizer_s=0.0, hbm_bytes=math.inf, static_bytes=0.0, bytes_per_token=0.0,
                     bytes_per_patch=0.0, device=data["device"], ranks_meet=data["ranks_meet"], **coefficients)
