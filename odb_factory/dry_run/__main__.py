"""`python -m odb_factory.dry_run RECIPE.yaml [options] [key=value ...]`: the dry run's command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

DESCRIPTION = """\
Dry run of a LLaMA-Factory training recipe (stage sft, pt or dpo): what ODB would do with it,
without training. The recipe is parsed as `llamafactory-cli train` parses it (key=value
overrides included); the training rows (all, or --rows N of them) go through the run's own
template, tokenisation and vision-token expansion in worker processes; then one epoch is
planned for --world-size ranks with LLaMA-Factory's fixed batches (Standard) and ODB's
`odb_step: samples` and `groups` (stage dpo: samples only, as training), using the engine's
own planner. No model weights are loaded.
"""

EPILOG = """\
figures (one epoch):
  Standard             LLaMA-Factory's per_device_train_batch_size x gradient_accumulation_steps
                       batches, in a seeded order (the Trainer's sampler draws another order
                       of the same counts); stage dpo: batches of pairs, each pair two rows
                       padded to its longer side
  tokens               what the run's cost function counts: a row's LLM tokens; a dpo pair's
                       two rows of its longer side, padded to the collator's multiple of 8
  CV                   population std / mean of the rows' LLM tokens
  f_s                  share of rows with at most 512 LLM tokens
  vision share         vision tokens / all LLM tokens
  padded waste         padding / tokens the micro-batches occupy (n x longest, rounded to the
                       collator's multiple: 8 for sft and dpo, none for pt; real tokens for
                       odb_cost_mode: packed); a dpo pair's padding of its shorter side counts
                       as its tokens (any batching that keeps pairs whole has it)
  max/LB               per micro-step, the busiest rank's occupied tokens over the ranks' mean
                       (the slowest rank's lower bound), summed over the epoch before dividing
  IDLE slots           (micro-step, rank) pairs with no sample, all ranks
  largest micro-batch  most tokens one micro-batch occupies
  speedup              ODB samples/s over Standard's, from the step-time model (H20 GPUs, the
                       recipe's model counted on the meta device; stage dpo: each pair's rows
                       attend apart, and the reference model's forward is counted; with
                       --step-model, the coefficients measured in that file instead). ODB's
                       logits are priced at the supervised positions only where the run
                       computes only those (odb_supervised_logits) and the model prices its
                       LM head apart (a measured model); Standard's at every position
  band                 {band}
  suggested budget     {rule}
rows cut by cutoff_len and rows over the budget are named by their training-row number, as the
run's errors and audit ledger name them. With --rows N the statistics are over the N measured
rows and the plan gives the other rows the numbers of measured rows drawn at random.
"""


ODB_MODES = ("samples", "groups")


def _workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _default_world() -> int:
    """llamafactory-cli's launch variables when set, else one rank."""
    return int(os.environ.get("NNODES", "1")) * int(os.environ.get("NPROC_PER_NODE", "1"))


def parser() -> argparse.ArgumentParser:
    import textwrap

    from .budget import RULE
    from .speedup import BAND
    indent = "\n" + " " * 23
    epilog = EPILOG.format(band=indent.join(textwrap.wrap(BAND, 72)).strip(),
                           rule=indent.join(textwrap.wrap(RULE, 72)).strip())
    p = argparse.ArgumentParser(prog="python -m odb_factory.dry_run", description=DESCRIPTION, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="LLaMA-Factory training YAML (or JSON)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides, as llamafactory-cli takes them (e.g. odb_token_budget=8192)")
    p.add_argument("--world-size", type=int, default=_default_world(),
                   help="ranks to plan for (default: NNODES x NPROC_PER_NODE if set, else 1)")
    p.add_argument("--rows", type=int, default=None,
                   help="measure a seeded random sample of N training rows instead of all")
    p.add_argument("--workers", type=int, default=_workers(),
                   help="worker processes running the pipeline (default: the usable CPUs; 0: in this process)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="step model: GPUs per node (default 8)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="step model: memory per GPU for the out-of-memory test (default: the H20's 96)")
    p.add_argument("--step-model", metavar="PATH", default=None,
                   help="price with the step model measured in PATH (python -m bench.cpu_layer --fit-out) "
                        "instead of the H20's, for the ranks and device it was measured on (text rows only)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the figures as JSON to PATH ('-': print JSON instead of the text)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def make_plan(a: argparse.Namespace) -> dict:
    import numpy as np

    from ..planning.grouping import Budget
    from ..simulation.measured import measured_step_model
    from ..simulation.pricing import features
    from ..simulation.schedules import costs_of
    from . import budget, pipeline, recipe, report, speedup

    if a.world_size < 1:
        raise ValueError(f"--world-size {a.world_size}: at least one rank is needed")
    hw = speedup.hardware(a.world_size, a.gpus_per_node, a.gpu_memory_gb)  # a bad shape fails first
    measured_model = measured_step_model(Path(a.step_model), a.world_size) if a.step_model else None
    started = time.perf_counter()
    r = recipe.parse(Path(a.recipe), a.overrides,
                     on_cpu=measured_model is not None and measured_model.device == "cpu")
    r.odb.decide_balance(a.world_size)  # `odb_balance: auto`, as the run's trainer settles it
    data = pipeline.training_set(r)
    loaded = time.perf_counter()
    total = len(data.dataset)
    seed = r.training_args.seed
    measured = pipeline.measure(data, pipeline.choose_rows(total, a.rows, seed), max(0, a.workers),
                                progress=not a.no_progress)
    row_numbers = np.asarray(data.dataset.rows)
    if not len(measured.positions):
        position, error = measured.failures[0]
        raise ValueError(f"the pipeline failed on every measured row; training row {row_numbers[position]}: {error}")
    rows = report.rows_from(measured.values, measured.positions, total, data.spatial_merge_size, seed,
                            r.stage.rows_per_sample)
    cfg = dataclasses.replace(r.planning_config(), vision_token_ids=data.vision_token_ids,
                              spatial_merge_size=data.spatial_merge_size)
    # a mode training refuses for the stage is not planned (stage dpo: groups)
    refused = {m: why for m in ODB_MODES if (why := r.stage.step_refusal(m))}
    modes = [m for m in ODB_MODES if m not in refused]
    schedules = report.mode_schedules(rows, cfg, a.world_size, modes)
    attention = r.packed_attention
    kept = supervised_logits(r, speedup.computes_chosen_logits(data.model_config))
    feats = {name: features(s, rows, attention, kept.get(name, False)) for name, s in schedules.items()}
    spec = speedup.model_spec(data.model_config, r.finetuning_args.lora_rank, r.model_args.trust_remote_code)
    finetuning = r.finetuning_args.finetuning_type
    reference = speedup.reference_model(r.finetuning_args)
    if measured_model is not None and rows.images.any():
        raise ValueError(f"--step-model {a.step_model} prices text rows only (it has no vision terms); the "
                         "recipe's rows hold images: plan without it (the H20's step model prices vision)")
    model = measured_model or speedup.step_model(spec, hw, finetuning, reference)
    predicted = speedup.predicted(feats["standard"], {m: feats[m] for m in modes}, rows, model,
                                  band=measured_model is None)
    faster = faster_setting(r, cfg, rows, schedules["standard"], feats["standard"], predicted, model, a.world_size,
                            getattr(data.model_config, "model_type", None), kept.get(cfg.step_mode, False))
    suggestion = budget.suggest(rows, cfg, a.world_size, cfg.step_mode, schedules["standard"],
                                costs_of(rows), model, attention, kept.get(cfg.step_mode, False))
    args, data_args = r.training_args, r.data_args
    return {
        "recipe": str(a.recipe), "overrides": list(a.overrides),
        "settings": {
            "stage": r.stage.name, "rows_per_sample": r.stage.rows_per_sample,
            "world_size": a.world_size, "per_device_train_batch_size": r.batch_size,
            "gradient_accumulation_steps": r.accumulation, "num_train_epochs": args.num_train_epochs,
            "max_steps": args.max_steps, "cutoff_len": data_args.cutoff_len,
            "odb_enable": r.odb_enabled, "odb_step": cfg.step_mode, "odb_token_budget": cfg.token_budget,
            "odb_token_budget_reason": r.odb.token_budget_reason,
            "odb_cost_mode": cfg.cost_mode, "odb_buffer_size": cfg.buffer_size, "odb_join": cfg.join,
            "odb_padding_free": bool(r.odb.padding_free), "odb_padding_free_reason": r.odb.padding_free_reason,
            "packed_attention": attention,
            "odb_over_budget": cfg.over_budget, "odb_max_vision_patches": cfg.max_vision_patches,
            "pad_to_multiple_of": cfg.pad_to_multiple_of, "seed": cfg.seed, "set_aside": r.set_aside,
            "odb_balance": r.odb.value_of("odb_balance"), "odb_balance_reason": r.odb.balance_reason},
        "rows": {"training_rows": total, "dropped_malformed": data.converted_rows - total,
                 "measured": int(len(measured.positions)), "note": report.sample_note(len(measured.positions), total),
                 "pipeline_seconds": measured.seconds, "workers": measured.workers,
                 "rows_per_second": (len(measured.positions) + len(measured.failures)) / measured.seconds
                 if measured.seconds else None},
        "failed_rows": report.failures(measured.failures, row_numbers),
        "lengths": report.length_stats(rows),
        "cut_by_cutoff_len": report.cut_rows(rows, row_numbers),
        "over_budget": report.over_budget_rows(rows, Budget.from_config(cfg), row_numbers),
        "plan": {name: report.batching_figures(schedules[name], feats[name], cfg.pad_to_multiple_of)
                 if name in schedules else None for name in ("standard", *ODB_MODES)},
        "refused_modes": refused,
        "speedup": {**predicted, **{m: None for m in refused},
                    "step_model": (speedup.describe_measured(model, a.step_model) if measured_model
                                   else speedup.describe(spec, hw, model, finetuning, reference)),
                    "supervised_logits": {m: kept.get(m, False) for m in modes},
                    "band": speedup.MEASURED_BAND if measured_model else speedup.BAND, "faster_setting": faster},
        "suggested_token_budget": suggestion,
        "seconds": {"recipe_and_data": loaded - started, "pipeline": measured.seconds,
                    "planning": time.perf_counter() - loaded - measured.seconds,
                    "total": time.perf_counter() - started},
    }


def supervised_logits(r, model_takes_positions: bool) -> dict:
    """Per ODB mode, whether its training forwards compute logits at the supervised positions
    only, as the trainer decides: `odb_supervised_logits` on a model whose forward takes
    `logits_to_keep`; `samples` mode always, `groups` mode when its loss is the window's token
    sum (`odb_loss_scaling` standard or exact); stage dpo's pairwise loss reads every position."""
    if not (r.odb.adapter.supervised_logits and model_takes_positions) or r.stage.name == "dpo":
        return {}
    return {"samples": True, "groups": r.odb.config.loss_scaling in ("standard", "exact")}


def faster_setting(r, cfg, rows, standard, standard_features, predicted, model, world: int,
                   model_type: Optional[str], kept: bool = False) -> Optional[dict]:
    """Where the recipe's ODB mode is predicted slower than Standard: the setting that would be
    faster (padding-free groups, or per-segment attention for packed rows) and its prediction;
    None when the recipe is not predicted slower or no such setting helps."""
    from ..llamafactory.padding_free import padding_free_refusal
    from ..simulation.pricing import features
    from ..simulation.schedules import costs_of
    from . import report, speedup
    mode = cfg.step_mode
    ours = predicted[mode]["speedup"]
    if ours is None or ours >= 1.0:
        return None
    if (cfg.cost_mode == "padded" and padding_free_refusal(model_type) is None
            and r.stage.padding_free_refusal() is None):
        setting, other = "odb_padding_free: true", dataclasses.replace(cfg, cost_mode="packed", balance_mode="lpt")
    elif cfg.cost_mode == "packed" and r.packed_attention == "mask":
        setting, other = "odb_packed_attention: segments", cfg
    else:
        return None
    schedule = report.schedule_for(mode, other, world, standard, costs_of(rows))
    theirs = speedup.predicted(standard_features, {mode: features(schedule, rows, "segments", kept)},
                               rows, model)[mode]
    if theirs["speedup"] is None or theirs["speedup"] <= ours:
        return None
    return {"mode": mode, "speedup": ours, "setting": setting, "setting_speedup": theirs["speedup"]}


def main(argv: Optional[List[str]] = None) -> int:
    a = parser().parse_intermixed_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # LLaMA-Factory sets its log level when first imported; its info lines would bury the plan.
    os.environ.setdefault("LLAMAFACTORY_VERBOSITY", "WARNING")
    from .recipe import RecipeError
    try:
        # Libraries print to stdout while loading (LLaMA-Factory's log handler binds it on
        # import): keep stdout for the plan.
        with contextlib.redirect_stdout(sys.stderr):
            plan = make_plan(a)
    except (RecipeError, FileNotFoundError, ValueError) as exc:
        print(f"odb_factory.dry_run: error: {exc}", file=sys.stderr)
        return 2
    if a.json == "-":
        print(json.dumps(plan, indent=1))
        return 0
    if a.json:
        Path(a.json).write_text(json.dumps(plan, indent=1) + "\n")
    from .render import text
    print(text(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
