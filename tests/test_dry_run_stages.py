"""`python -m odb_factory.dry_run` on stage pt and stage dpo recipes over the shared demo data and
the tiny text Qwen3, its figures checked against LLaMA-Factory's own eager preprocessing and, for
dpo, against a real ODB training run (its optimizer steps and its audit ledger's pair costs);
every other stage, and what training refuses for dpo, refused with the reason."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import lf_runs
from tests.helpers.lf_runs import base_yaml, env, ledger, log_history, train

pytest.importorskip("llamafactory")

PAD = 8                 # LLaMA-Factory's pairwise collator pads to a multiple of 8
CUTOFF = 256            # cuts some of the demo rows, not all
PAIRS, PAIR_BATCH, PAIR_ACCUMULATION = 64, 2, 2
DOCS, DOC_WORLD, DOC_ACCUMULATION = 96, 2, 4


def _roundup(n: int, m: int = PAD) -> int:
    return -(-n // m) * m


@pytest.fixture(scope="module")
def demo_sets(tmp_path_factory):
    """The shared alpaca demo file read in place, as preference pairs (the answer chosen, the
    instruction echoed back rejected; as tests/llamafactory/test_stage_dpo.py) and as documents
    (the answers; as test_stage_pt.py)."""
    if not lf_runs.SHARED_DEMO.exists():
        pytest.skip("shared LLaMA-Factory demo data is absent")
    data = tmp_path_factory.mktemp("stage_data")
    alpaca = str(lf_runs.SHARED_DEMO / "alpaca_en_demo.json")
    (data / "dataset_info.json").write_text(json.dumps({
        "pairs": {"file_name": alpaca, "ranking": True,
                  "columns": {"prompt": "instruction", "query": "input", "chosen": "output", "rejected": "instruction"}},
        "docs": {"file_name": alpaca, "columns": {"prompt": "output"}}}))
    return data


def _dpo_yaml(model, data, out, **extra):
    return base_yaml(model, data, out, **{
        "stage": "dpo", "dataset": "pairs", "template": "qwen3_nothink", "cutoff_len": CUTOFF, "max_samples": PAIRS,
        "per_device_train_batch_size": PAIR_BATCH, "gradient_accumulation_steps": PAIR_ACCUMULATION,
        "pref_beta": 0.1, "seed": 3, **extra})


def _pt_yaml(model, data, out, **extra):
    return base_yaml(model, data, out, **{
        "stage": "pt", "dataset": "docs", "template": "qwen3_nothink", "cutoff_len": CUTOFF, "max_samples": DOCS,
        "per_device_train_batch_size": 1, "gradient_accumulation_steps": DOC_ACCUMULATION, "seed": 3, **extra})


def _dry_run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "odb_factory.dry_run", *args, "--no-progress"], env=env(),
                          capture_output=True, text=True, timeout=timeout)


def _write(config: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def _eager(config: dict, data_stage: str) -> list:
    """Every processed training sample of `config`, from LLaMA-Factory's own eager `get_dataset`
    (upstream's datasets.map: no odb_* key, so nothing of ours runs)."""
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer
    model_args, data_args, training_args, _, _ = get_train_args(dict(config, use_cpu=True))
    tokenizer = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer["tokenizer"], data_args)
    return list(get_dataset(template, model_args, data_args, training_args, data_stage, **tokenizer)["train_dataset"])


@pytest.mark.slow
def test_dpo_plan_costs_pairs_as_training_does(tmp_path, text_model, demo_sets):
    """Each pair is one sample costing two rows of its longer side padded to 8 (training's
    PairCost): the plan's pair costs sum to what an ODB training run's audit ledger records, and
    its optimizer steps are the steps that run takes; groups mode and padding-free rows are not
    planned, as training refuses them; the speedup counts the reference model's forward."""
    audit = tmp_path / "audit"
    recipe = _write(_dpo_yaml(text_model, demo_sets, tmp_path / "out", odb_enable=True, odb_token_budget=2048),
                    tmp_path / "dpo.yaml")
    proc = _dry_run(str(recipe), "--world-size", "1", "--workers", "1", "--json", str(tmp_path / "plan.json"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    plan = json.loads((tmp_path / "plan.json").read_text())

    kept = [[len(p["chosen_input_ids"]), len(p["rejected_input_ids"])]
            for p in _eager(_dpo_yaml(text_model, demo_sets, tmp_path / "eager"), "rm")]
    full = [[len(p["chosen_input_ids"]), len(p["rejected_input_ids"])]
            for p in _eager(_dpo_yaml(text_model, demo_sets, tmp_path / "eager", cutoff_len=1 << 20), "rm")]
    costs = [2 * _roundup(max(sides)) for sides in kept]
    assert plan["rows"]["training_rows"] == len(kept) == PAIRS
    assert plan["lengths"]["mean_tokens"] * PAIRS == pytest.approx(sum(costs))
    assert plan["lengths"]["max_tokens"] == max(costs)
    assert plan["lengths"]["mean_label_tokens"] == 1.0   # a pair is one term of the DPO loss's mean
    cut = [i for i, (k, f) in enumerate(zip(kept, full)) if k != f]
    assert cut, "the recipe should cut some pairs"
    assert plan["cut_by_cutoff_len"] == {"count": len(cut), "first": cut[:10],
                                         "tokens_cut": sum(sum(f) - sum(k) for k, f in zip(kept, full))}

    steps = math.ceil(PAIRS / (PAIR_BATCH * PAIR_ACCUMULATION))
    standard, samples = plan["plan"]["standard"], plan["plan"]["samples"]
    assert standard["optimizer_steps"] == samples["optimizer_steps"] == steps
    assert standard["micro_batches"] == PAIRS // PAIR_BATCH   # per_device_train_batch_size pairs, not rows
    assert standard["largest_micro_batch_tokens"] <= PAIR_BATCH * max(costs)
    assert samples["micro_batches"] < standard["micro_batches"]
    assert plan["plan"]["groups"] is None and plan["speedup"]["groups"] is None
    assert plan["refused_modes"]["groups"].startswith("odb_step: groups: stage dpo trains the fixed-batch run's steps")
    settings = plan["settings"]
    assert (settings["stage"], settings["rows_per_sample"], settings["pad_to_multiple_of"]) == ("dpo", 2, PAD)
    assert settings["odb_padding_free"] is False and "stage dpo" in settings["odb_padding_free_reason"]
    assert plan["speedup"]["step_model"]["reference_model"] == "copy"   # full fine-tuning: a frozen copy
    assert plan["speedup"]["faster_setting"] is None
    assert "ODB groups not planned: odb_step: groups: stage dpo" in proc.stdout
    assert "groups n/a (not planned)" in proc.stdout

    train(_dpo_yaml(text_model, demo_sets, tmp_path / "trained", odb_enable=True, odb_token_budget=2048,
                    odb_audit_dir=str(audit)))
    rows = ledger(audit)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [h["step"] for h in log_history(tmp_path / "trained") if "loss" in h] == list(range(1, steps + 1))
    assert sorted(i for r in rows for i in r["indices"]) == list(range(PAIRS))
    assert sum(r["input_tokens"] for r in rows) == sum(costs)


def test_pt_plan_without_odb_keys_plans_whole_documents(tmp_path, text_model, demo_sets):
    """A pt recipe that does not turn ODB on is planned as ODB would train it: each document a
    sample of its own length (the unset `packing` becomes false), padded by pt's collator to the
    longest row only (no multiple of 8)."""
    recipe = _write(_pt_yaml(text_model, demo_sets, tmp_path / "out"), tmp_path / "pt.yaml")
    proc = _dry_run(str(recipe), "--world-size", str(DOC_WORLD), "--workers", "1", "--json", str(tmp_path / "plan.json"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    plan = json.loads((tmp_path / "plan.json").read_text())

    full = [len(d["input_ids"]) for d in _eager(_pt_yaml(text_model, demo_sets, tmp_path / "eager",
                                                         packing=False, cutoff_len=1 << 20), "pt")]
    kept = [min(n, CUTOFF) for n in full]
    assert plan["rows"]["training_rows"] == len(full) == DOCS
    assert plan["lengths"]["mean_tokens"] * DOCS == pytest.approx(sum(kept))
    assert plan["lengths"]["max_tokens"] == max(kept) == CUTOFF
    cut = [i for i, n in enumerate(full) if n > CUTOFF]
    assert cut and plan["cut_by_cutoff_len"] == {"count": len(cut), "first": cut[:10],
                                                 "tokens_cut": sum(full[i] - CUTOFF for i in cut)}

    steps = math.ceil(DOCS / (DOC_WORLD * DOC_ACCUMULATION))
    standard, samples, groups = (plan["plan"][m] for m in ("standard", "samples", "groups"))
    assert standard["optimizer_steps"] == samples["optimizer_steps"] == steps
    assert groups["samples"] == DOCS
    # batch 1 under a collator that pads to the longest row only: no padding at all
    assert standard["padded_waste"] == 0.0 and standard["largest_micro_batch_tokens"] == CUTOFF
    settings = plan["settings"]
    assert (settings["stage"], settings["odb_enable"], settings["pad_to_multiple_of"]) == ("pt", False, 1)
    assert plan["speedup"]["step_model"]["reference_model"] == "none"
    assert plan["refused_modes"] == {}


def test_other_stages_and_what_training_refuses_for_dpo_are_refused(tmp_path, text_model, demo_sets):
    """Refused before LLaMA-Factory is imported: stage kto (naming it and the stages planned), a
    dpo recipe in groups mode or with padding-free rows (training's own messages), pt packing."""
    cases = {
        "kto": (base_yaml(text_model, demo_sets, tmp_path / "o", stage="kto", dataset="pairs",
                          template="qwen3_nothink"), "stage: kto: the dry run plans the stages ODB trains, sft, pt, dpo"),
        "groups": (_dpo_yaml(text_model, demo_sets, tmp_path / "o", odb_step="groups"),
                   "odb_step: groups: stage dpo trains the fixed-batch run's steps (odb_step: samples)"),
        "padding_free": (_dpo_yaml(text_model, demo_sets, tmp_path / "o", odb_enable=True, odb_padding_free=True),
                         "odb_padding_free: true: stage dpo reads a batch as its chosen rows"),
        "packing": (_pt_yaml(text_model, demo_sets, tmp_path / "o", packing=True),
                    "packing/neat_packing: ODB forms token-budgeted groups itself"),
    }
    for name, (config, message) in cases.items():
        proc = _dry_run(str(_write(config, tmp_path / f"{name}.yaml")), timeout=120)
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        assert message in proc.stderr and "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
