"""Predicted speedup of ODB over LLaMA-Factory's fixed batches, from the step-time model.

The model (`odb_factory.simulation.step_model`) needs the architecture's numbers: they are
counted from the recipe's own model, built on PyTorch's meta device (shapes only, no weights
read or allocated). The hardware is the step model's H20 (`--gpus-per-node` per node), or,
with `--step-model`, the machine a measured model was fitted on (`odb_factory.simulation.measured`:
its coefficients replace the derived ones, and it has no band).

Stage dpo is priced as it trains: a pair's two rows attend apart (the plan's rows say
`rows_per_sample` 2, so its attention counts l²/2 of its l tokens), Standard's micro-batch is
per_device_train_batch_size pairs of two padded rows each, and the reference model's forward
runs beside every micro-batch (`reference_model`).

The step model has no error bars of its own: one efficiency (MFU) is calibrated, and the fixed
time per micro-batch and the collective bandwidth are assumptions. The band is the range of
the predicted speedup over those three: MFU from half the calibrated value to the calibrated
value, the per-micro-batch fixed time from half to twice its value, and the collectives from
their value to twice it (half the bandwidth); every corner of that box is priced.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from collections import Counter
from typing import Any, Dict, Optional

from ..simulation.pricing import Features, Result, evaluate
from ..simulation.step_model import DEFAULT_MFU, GB, Hardware, ModelSpec, StepModel, build_step_model

MFU_RATIOS = (0.5, 1.0)        # x the calibrated MFU
FIXED_TIME_FACTORS = (0.5, 2.0)  # x c0 (kernel launches + framework time per micro-batch)
COLLECTIVE_FACTORS = (1.0, 2.0)  # x gradient reduce-scatter and parameter all-gather time
BAND = ("the predicted speedup's range over the step model's three non-spec quantities: "
        f"MFU {MFU_RATIOS[0]:g}-{MFU_RATIOS[1]:g}x the calibrated {DEFAULT_MFU:g}, fixed time per "
        f"micro-batch {FIXED_TIME_FACTORS[0]:g}-{FIXED_TIME_FACTORS[1]:g}x, collective time "
        f"{COLLECTIVE_FACTORS[0]:g}-{COLLECTIVE_FACTORS[1]:g}x (every corner priced); a sensitivity "
        "range, not a confidence interval")
MEASURED_BAND = ("none: a measured step model has no assumed quantities to vary; how far its "
                 "predictions fall from measured runs is bench.plan_check's figure")


def _vision(name: str) -> bool:
    return "visual" in name or "vision" in name


def model_spec(config: Any, lora_rank: int = 8, trust_remote_code: bool = False) -> ModelSpec:
    """The step model's architecture numbers for `config`, counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = (AutoModelForImageTextToText if type(config) in AutoModelForImageTextToText._model_mapping
            else AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    params: Counter = Counter()
    for name, p in model.named_parameters():
        kind = ("vision" if _vision(name) else "embed" if "embed_tokens" in name
                else "head" if "lm_head" in name else "llm")
        params[kind] += p.numel()
    lora = sum(lora_rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not _vision(name) and "lm_head" not in name)
    text = config.get_text_config()
    vision = getattr(config, "vision_config", None)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return ModelSpec(
        name=getattr(config, "model_type", "model"),
        total_params=float(sum(params.values())),
        llm_params=float(params["llm"] + params["embed"] + params["head"]),
        # every token runs the layers and the output projection (tied or not)
        llm_compute_params=float(params["llm"] + text.vocab_size * text.hidden_size),
        llm_layers=text.num_hidden_layers, hidden=text.hidden_size,
        attn_dim=text.num_attention_heads * head_dim, vocab=text.vocab_size,
        vision_params=float(params["vision"]),
        vision_layers=int(getattr(vision, "depth", getattr(vision, "num_hidden_layers", 0)) or 0),
        vision_width=int(getattr(vision, "hidden_size", 0) or 0),
        lora_params=float(lora))


def computes_chosen_logits(config: Any) -> bool:
    """Whether the recipe's model class computes logits at chosen positions only (its forward
    takes `logits_to_keep`), as ODB's `odb_supervised_logits` needs; False for a class
    transformers does not map (remote code), which prices every position."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
        if type(config) in auto._model_mapping:
            return "logits_to_keep" in inspect.signature(auto._model_mapping[type(config)].forward).parameters
    return False


def hardware(world: int, gpus_per_node: int, memory_gb: Optional[float]) -> Hardware:
    if gpus_per_node < 1 or (memory_gb is not None and memory_gb <= 0):
        raise ValueError("--gpus-per-node and --gpu-memory-gb must be positive")
    per_node = min(world, gpus_per_node)
    if world % per_node:
        raise ValueError(f"--world-size {world} is not a whole number of nodes of {gpus_per_node} "
                         "(--gpus-per-node)")
    base = Hardware("H20", nodes=world // per_node, gpus_per_node=per_node)
    name = f"{base.nodes}x{per_node}xH20" if base.nodes > 1 else f"{per_node}xH20"
    return dataclasses.replace(base, name=name, **({"hbm_bytes": memory_gb * GB} if memory_gb else {}))


def reference_model(finetuning_args: Any) -> str:
    """The reference model a run computes beside the trained one, as LLaMA-Factory's dpo
    workflow creates it (`use_ref_model`: stage dpo except the orpo and simpo losses): the
    trained model itself with its LoRA adapters off, or a frozen copy of the weights (full and
    freeze fine-tuning, or a `ref_model` of its own, priced as the recipe's architecture)."""
    if not getattr(finetuning_args, "use_ref_model", False):
        return "none"
    if finetuning_args.finetuning_type == "lora" and finetuning_args.ref_model is None:
        return "shared"
    return "copy"


def step_model(spec: ModelSpec, hw: Hardware, finetuning_type: str, reference: str = "none") -> StepModel:
    """LoRA runs are priced as LoRA; full and freeze runs as full fine-tuning; `reference`:
    `reference_model`."""
    return build_step_model(spec, hw, "lora" if finetuning_type == "lora" else "full", reference_model=reference)


def variants(m: StepModel):
    """The step model at every corner of the band's box."""
    for mfu, fixed, comm in itertools.product(MFU_RATIOS, FIXED_TIME_FACTORS, COLLECTIVE_FACTORS):
        yield dataclasses.replace(m.scaled(mfu), c0=m.c0 * fixed, idle_s=m.idle_s * fixed,
                                  comm_micro_s=m.comm_micro_s * comm, comm_opt_s=m.comm_opt_s * comm)


def ratio(odb: Result, standard: Result) -> Optional[float]:
    if odb.samples_per_s is None or standard.samples_per_s is None:
        return None
    return odb.samples_per_s / standard.samples_per_s


def predicted(standard: Features, modes: Dict[str, Features], rows, m: StepModel, band: bool = True) -> dict:
    """Speedup of each ODB mode over Standard at the calibrated point, with the band (none for
    `band=False`: a measured model has no assumed quantities to vary)."""
    base = evaluate(standard, rows, m)
    out = {"standard_oom_batches": base.oom_batches, "standard_samples_per_s": base.samples_per_s}
    corners = [(evaluate(standard, rows, v), v) for v in variants(m)] if band else []
    for mode, f in modes.items():
        point = evaluate(f, rows, m)
        spread = [ratio(evaluate(f, rows, v), std) for std, v in corners]
        spread = [s for s in spread if s is not None]
        out[mode] = {"speedup": ratio(point, base), "oom_batches": point.oom_batches,
                     "samples_per_s": point.samples_per_s,
                     "low": min(spread) if spread else None, "high": max(spread) if spread else None}
    return out


def describe(spec: ModelSpec, hw: Hardware, m: StepModel, finetuning_type: str, reference: str = "none") -> dict:
    return {"model": spec.name, "hardware": hw.name, "world": m.world,
            "finetuning": "lora" if finetuning_type == "lora" else "full", "reference_model": reference,
            "llm_params": spec.llm_params, "vision_params": spec.vision_params,
            "mfu": DEFAULT_MFU, "gpu_memory_gb": hw.hbm_bytes / GB,
            "memory_cap_tokens": max(0, m.cap_tokens), "fixed_s_per_micro_batch": m.c0,
            "tokens_per_s_per_gpu": 1.0 / m.a if m.a else math.inf}


def describe_measured(m: StepModel, path: str) -> dict:
    """The figures of a measured step model (`--step-model`), as `describe` gives a derived one's."""
    return {"model": m.name, "hardware": f"measured ({m.device}, {m.world} ranks)", "world": m.world,
            "measured_from": str(path), "fixed_s_per_micro_batch": m.c0, "s_per_token": m.a,
            "s_per_token_sq": m.b, "s_per_logit_position": m.head,
            "tokens_per_s_per_gpu": 1.0 / (m.a + m.head) if m.a + m.head else math.inf}
