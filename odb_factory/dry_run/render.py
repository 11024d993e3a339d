"""The dry run's figures as text (the JSON form is the same dictionary)."""

from __future__ import annotations

import textwrap
from typing import List, Optional

WIDTH = 100   # long lines wrap, continued under the text of their label

MODES = (("standard", "Standard"), ("samples", "ODB samples"), ("groups", "ODB groups"))
ROWS = (("optimizer steps", "optimizer_steps", "{:d}"),
        ("micro-batches (per rank)", "micro_batches", "{:d}"),
        ("samples per optimizer step", "samples_per_optimizer_step", "{:.1f}"),
        ("padded waste", "padded_waste", "{:.1%}"),
        ("max/LB", "max_over_lb", "{:.2f}"),
        ("IDLE slots (all ranks)", "idle_slots", "{:d}"),
        ("largest micro-batch (tokens)", "largest_micro_batch_tokens", "{:d}"))


# the step model's reference model (speedup.reference_model), as the step-model line names it
REFERENCES = {"none": "", "shared": " + the reference forward (the model, LoRA adapters off)",
              "copy": " + the reference forward (a frozen copy of the weights)"}


def _figure(figures: Optional[dict], key: str, fmt: str) -> str:
    return "n/a" if figures is None else fmt.format(figures[key])


def _rows_list(found: dict) -> str:
    if not found["count"]:
        return ""
    more = " ..." if found["count"] > len(found["first"]) else ""
    return ": rows " + ", ".join(str(r) for r in found["first"]) + more


def _speedup(entry: Optional[dict]) -> str:
    if entry is None:
        return "n/a (not planned)"
    if entry["speedup"] is None:
        return "n/a (out of memory)"
    band = ""
    if entry["low"] is not None:
        band = f" [{entry['low']:.2f}-{entry['high']:.2f}]"
    return f"{entry['speedup']:.2f}x{band}"


def _million(x: float) -> str:
    return f"{x / 1e9:.2f} B" if x >= 1e9 else f"{x / 1e6:.2f} M"


def text(plan: dict) -> str:
    s, rows, lengths = plan["settings"], plan["rows"], plan["lengths"]
    out: List[str] = [f"dry run of {plan['recipe']}" + (f" {' '.join(plan['overrides'])}" if plan["overrides"] else "")]
    epochs = f"{s['num_train_epochs']:g} epoch(s)" + (f", max_steps {s['max_steps']}" if s["max_steps"] > 0 else "")
    unit = " pairs" if s["rows_per_sample"] == 2 else ""
    out.append(f"  stage {s['stage']}, world size {s['world_size']}, batch {s['per_device_train_batch_size']}{unit} "
               f"x accumulation {s['gradient_accumulation_steps']}, {epochs}, cutoff_len {s['cutoff_len']}")
    enabled = "" if s["odb_enable"] else " (the recipe does not enable ODB: its odb_* settings or the defaults)"
    auto = " (auto: the value on an accelerator)" if s.get("odb_token_budget_reason") else ""
    out.append(f"  odb_step {s['odb_step']}, odb_token_budget {s['odb_token_budget']}{auto}, odb_cost_mode "
               f"{s['odb_cost_mode']}, odb_buffer_size {s['odb_buffer_size']}, padding to a multiple of "
               f"{s['pad_to_multiple_of']}{enabled}")
    groups = "padding-free" if s["odb_padding_free"] else "padded"
    attention = ("per sample (Σ len²)" if s["packed_attention"] == "segments"
                 else "through a dense block mask ((Σ len)² a row)")
    out.append(f"  {groups} groups ({s['odb_padding_free_reason'] or 'odb_padding_free'})"
               + (f"; packed rows attend {attention}" if s["odb_padding_free"] else ""))
    why = f" ({s['odb_balance_reason']})" if s.get("odb_balance_reason") else ""
    if s["odb_balance"]:
        out.append(f"  odb_balance{why}: samples mode's micro-steps are post-balanced as the run's loader does; "
                   "groups mode's figures are before post-balancing")
    elif why:
        out.append(f"  no post-balancing{why}")
    if s["set_aside"]:
        out.append(f"  set aside for the dry run (device settings): {', '.join(s['set_aside'])}")
    rate = f", {rows['rows_per_second']:.0f} rows/s" if rows["rows_per_second"] else ""
    out.append(f"rows      {rows['note']}; pipeline {rows['pipeline_seconds']:.1f} s with "
               f"{rows['workers']} worker(s){rate}; {rows['dropped_malformed']} malformed rows dropped "
               "by LLaMA-Factory's rules")
    failed = plan["failed_rows"]
    if failed["count"]:
        out.append(f"FAILED    {failed['count']} rows fail the pipeline; the run would stop at the first it "
                   f"reaches (planned with resampled numbers):")
        out += [f"            row {f['row']}: {f['error']}" for f in failed["first"]]
    out.append(f"lengths   mean {lengths['mean_tokens']:.1f} tokens (p50 {lengths['p50_tokens']:.0f}, "
               f"p99 {lengths['p99_tokens']:.0f}, max {lengths['max_tokens']}), CV {lengths['cv']:.2f}, "
               f"f_s {lengths['short_fraction']:.1%} (<= {lengths['short_threshold']} tokens), vision "
               f"{lengths['vision_share']:.1%} of tokens, {lengths['images_per_row']:.2f} images/row")
    if s["rows_per_sample"] == 2:
        out.append("          a pair's tokens are its two rows, each as long as its longer side padded to a "
                   f"multiple of {s['pad_to_multiple_of']} (the batch the pairwise collator builds)")
    cut = plan["cut_by_cutoff_len"]
    out.append(f"cutoff    {cut['count']} rows cut by cutoff_len {s['cutoff_len']}"
               + (f" ({cut['tokens_cut']} tokens cut off)" if cut["count"] else "") + _rows_list(cut))
    over = plan["over_budget"]
    policy = ("each is trained alone" if s["odb_over_budget"] == "singleton"
              else "odb_over_budget: error stops the run at the first")
    out.append(f"budget    {over['count']} rows over odb_token_budget {s['odb_token_budget']} on their own"
               + (f" ({policy})" if over["count"] else "") + _rows_list(over))
    out.append("")
    out.append(f"{'one epoch':<30}" + "".join(f"{label:>14}" for _, label in MODES))
    for label, key, fmt in ROWS:
        out.append(f"{label:<30}" + "".join(f"{_figure(plan['plan'][m], key, fmt):>14}" for m, _ in MODES))
    for mode, why in plan["refused_modes"].items():
        out.append(f"  ODB {mode} not planned: {why}")
    out.append("")
    sp = plan["speedup"]
    model = sp["step_model"]
    out.append(f"predicted speedup over Standard: samples {_speedup(sp['samples'])}, "
               f"groups {_speedup(sp['groups'])}")
    faster = sp.get("faster_setting")
    if faster:
        out.append(f"WARNING   ODB {faster['mode']} is predicted slower than Standard ({faster['speedup']:.2f}x); "
                   f"{faster['setting']} is predicted {faster['setting_speedup']:.2f}x")
    if sp["standard_oom_batches"]:
        out.append(f"  Standard has {sp['standard_oom_batches']} micro-batches over the memory figure")
    if "measured_from" in model:
        out.append(f"  step model: {model['hardware']}, from {model['measured_from']}: "
                   f"{model['fixed_s_per_micro_batch'] * 1e3:.1f} ms per micro-batch, "
                   f"{model['s_per_token'] * 1e3:.3f} ms per token, {model['s_per_token_sq'] * 1e9:.3f} ns per "
                   f"token² of attention, {model['s_per_logit_position'] * 1e3:.3f} ms per position's logits")
    else:
        reference = REFERENCES[model["reference_model"]]
        out.append(f"  step model: {model['model']} ({_million(model['llm_params'])} LLM, "
                   f"{_million(model['vision_params'])} vision parameters), {model['finetuning']} fine-tuning"
                   f"{reference} on {model['hardware']}, MFU {model['mfu']:g}, {model['gpu_memory_gb']:g} GB per GPU")
    out.append(f"  band: {sp['band']}")
    sug = plan["suggested_token_budget"]
    value: Optional[int] = sug["value"]
    out.append(f"suggested odb_token_budget: {value if value is not None else 'none'} "
               f"({sug['rule']})" + (f"; {sug['reason']}" if value is None else ""))
    t = plan["seconds"]
    out.append(f"dry run: {t['total']:.0f} s (recipe and data {t['recipe_and_data']:.0f} s, pipeline "
               f"{t['pipeline']:.0f} s, planning {t['planning']:.0f} s)")
    return "\n".join(_wrap(line) for line in out)


def _wrap(line: str) -> str:
    if len(line) <= WIDTH:
        return line
    indent = " " * (10 if line[:1] != " " else len(line) - len(line.lstrip()) + 2)
    return "\n".join(textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False))
