"""`python -m odb_factory.dry_run` as a user runs it: a subprocess on a tiny recipe over the tiny
Qwen3-VL and the generated demo set, its figures checked against numbers computed here
without the plan's code: the rows' lengths from LLaMA-Factory's own eager preprocessing,
the images from the data files, the step counts from the batch arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.lf_runs import base_yaml, env

WORLD, BATCH, ACCUMULATION = 2, 1, 4
CUTOFF = 200          # cuts a few text-heavy rows of the demo set, none inside an image
BUDGET = 192          # below the longest rows: some rows are over it on their own
PAD = 8               # LLaMA-Factory's collator pads training batches to a multiple of 8


def _roundup(n: int, m: int = PAD) -> int:
    return -(-n // m) * m


def _recipe(tiny_model, demo_data, tmp_path) -> Path:
    config = base_yaml(tiny_model, demo_data, tmp_path / "out", cutoff_len=CUTOFF,
                       per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION,
                       odb_enable=True, odb_step="samples", odb_token_budget=BUDGET,
                       odb_padding_free=False)  # padded figures, computed independently below
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _plan(log: Path, *args: str) -> tuple:
    """Start a dry run; its output goes to files (a full pipe would stall it meanwhile)."""
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "odb_factory.dry_run", *args, "--no-progress"],
                                env=env(), stdout=stdout, stderr=stderr, text=True)
    return proc, out, err


def _finished(started: tuple, timeout: float = 300) -> subprocess.CompletedProcess:
    proc, out, err = started
    proc.wait(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())


def _eager_lengths(tiny_model, demo_data, out_dir) -> list:
    """Every row's LLM tokens before cutoff_len, from LLaMA-Factory's own eager `get_dataset`
    (upstream's datasets.map over the whole set: no odb_* key, so nothing of ours runs)."""
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer
    config = base_yaml(tiny_model, demo_data, out_dir, cutoff_len=1 << 20, use_cpu=True)
    model_args, data_args, training_args, _, _ = get_train_args(config)
    tokenizer = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer["tokenizer"], data_args)
    train = get_dataset(template, model_args, data_args, training_args, "sft", **tokenizer)["train_dataset"]
    return [len(ids) for ids in train["input_ids"]]


@pytest.fixture(scope="module")
def runs(tiny_model, demo_data, tmp_path_factory):
    """Both dry runs (all rows; a sample of 40) start together, and the independent lengths
    are computed while they run: the three share the start-up cost of LLaMA-Factory's import."""
    tmp = tmp_path_factory.mktemp("plan")
    recipe = _recipe(tiny_model, demo_data, tmp)
    full = _plan(tmp / "full", str(recipe), "--world-size", str(WORLD), "--json", str(tmp / "plan.json"))
    sampled = _plan(tmp / "sampled", str(recipe), "--world-size", str(WORLD), "--rows", "40", "--json", "-",
                    "--workers", "1", "odb_padding_free=auto", "odb_token_budget=auto")
    try:
        lengths = _eager_lengths(tiny_model, demo_data, tmp / "eager")
    except BaseException:
        full[0].kill()
        sampled[0].kill()
        raise
    return {"full": (_finished(full), tmp / "plan.json"), "sampled": _finished(sampled), "lengths": lengths}


def _vision_tokens(demo_data: Path) -> tuple:
    """(images, vision tokens) of the data set: the tiny Qwen3-VL turns a w x h image (sides
    multiples of 32, inside image_min/max_pixels) into (w/32)*(h/32) tokens."""
    from PIL import Image
    rows = json.loads((demo_data / "demo.json").read_text())
    sizes = [Image.open(demo_data / name).size for row in rows for name in row["images"]]
    return len(sizes), sum((w // 32) * (h // 32) for w, h in sizes), len(rows)


def test_plan_figures_match_an_independent_computation(demo_data, runs):
    proc, out = runs["full"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    plan = json.loads(out.read_text())
    full = runs["lengths"]
    kept = [min(n, CUTOFF) for n in full]   # a cut row is filled to cutoff_len exactly
    images, vision, rows = _vision_tokens(demo_data)

    assert plan["rows"]["training_rows"] == rows == len(full)
    assert plan["rows"]["measured"] == rows and plan["failed_rows"]["count"] == 0
    lengths = plan["lengths"]
    assert lengths["rows"] == rows
    assert lengths["mean_tokens"] == pytest.approx(sum(kept) / rows)
    assert lengths["max_tokens"] == max(kept)
    assert lengths["short_fraction"] == pytest.approx(sum(n <= 512 for n in kept) / rows)
    assert lengths["images_per_row"] * rows == pytest.approx(images)
    assert lengths["vision_share"] * sum(kept) == pytest.approx(vision)

    cut = [i for i, n in enumerate(full) if n > CUTOFF]
    assert cut, "the recipe should cut some rows"
    assert plan["cut_by_cutoff_len"] == {"count": len(cut), "first": cut[:10],
                                         "tokens_cut": sum(full[i] - CUTOFF for i in cut)}
    over = [i for i, n in enumerate(kept) if _roundup(n) > BUDGET]
    assert over and plan["over_budget"] == {"count": len(over), "first": over[:10]}

    steps = math.ceil(rows / (WORLD * BATCH * ACCUMULATION))
    standard, samples, groups = (plan["plan"][m] for m in ("standard", "samples", "groups"))
    assert standard["optimizer_steps"] == samples["optimizer_steps"] == steps
    assert standard["micro_batches"] == math.ceil(rows / (WORLD * BATCH))
    assert samples["samples"] == standard["samples"] == steps * WORLD * BATCH * ACCUMULATION
    assert groups["samples"] == rows   # join: every row once
    # batch 1: Standard's only padding is the collator's rounding of each row
    assert standard["padded_waste"] == pytest.approx(1 - sum(kept) / sum(_roundup(n) for n in kept))
    assert standard["largest_micro_batch_tokens"] == _roundup(max(kept))
    # ODB micro-batches stay within the budget, except a row over it, trained alone
    alone = max(_roundup(kept[i]) for i in over)
    for mode in (samples, groups):
        assert mode["largest_micro_batch_tokens"] <= max(BUDGET, alone)
        assert mode["micro_batches"] <= standard["micro_batches"]
    assert groups["optimizer_steps"] == math.ceil(groups["micro_batches"] / ACCUMULATION)

    speed = plan["speedup"]
    for mode in ("samples", "groups"):
        entry = speed[mode]
        assert entry["low"] <= entry["speedup"] <= entry["high"]
    suggested = plan["suggested_token_budget"]["value"]
    assert suggested >= max(kept) and suggested % 256 == 0

    assert (plan["settings"]["odb_padding_free"], plan["settings"]["odb_padding_free_reason"]) == \
        (False, "odb_padding_free: false")
    text = proc.stdout
    assert f"{len(cut)} rows cut by cutoff_len {CUTOFF}" in text
    assert "padded groups (odb_padding_free: false)" in text
    table = {line[:30].strip(): line[30:].split() for line in text.splitlines() if line[:30].strip()}
    assert table["optimizer steps"] == [str(standard["optimizer_steps"]), str(samples["optimizer_steps"]),
                                        str(groups["optimizer_steps"])]


def test_sampled_rows_plan_the_whole_epoch(runs):
    proc, eager_lengths = runs["sampled"], runs["lengths"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    plan = json.loads(proc.stdout)   # stdout is the JSON alone
    rows = len(eager_lengths)
    assert plan["rows"]["measured"] == plan["lengths"]["rows"] == 40
    assert plan["rows"]["training_rows"] == rows
    assert plan["plan"]["standard"]["optimizer_steps"] == math.ceil(rows / (WORLD * BATCH * ACCUMULATION))
    assert plan["plan"]["groups"]["samples"] == rows
    # auto on the tiny Qwen3-VL: padding-free groups, whose budget counts real tokens
    settings = plan["settings"]
    assert (settings["odb_padding_free"], settings["odb_cost_mode"], settings["packed_attention"]) == \
        (True, "packed", "segments")
    assert "'qwen3_vl' trains packed rows" in settings["odb_padding_free_reason"]
    # auto budget: the dry run prices GPUs, so it plans the accelerator's budget (a CPU run's is 1024)
    assert settings["odb_token_budget"] == 4096
    assert settings["odb_token_budget_reason"] == "odb_token_budget: auto, odb_step: samples on an accelerator"
    # the cut rows listed are measured ones, with their own numbers
    for row in plan["cut_by_cutoff_len"]["first"]:
        assert eager_lengths[row] > CUTOFF


def test_bad_key_and_missing_file_are_named(tiny_model, demo_data, tmp_path):
    recipe = _recipe(tiny_model, demo_data, tmp_path)
    proc = _finished(_plan(tmp_path / "bad_key", str(recipe), "odb_token_budgte=1024"), timeout=120)
    assert proc.returncode == 2
    assert "odb_token_budgte" in proc.stderr and "did you mean 'odb_token_budget'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _finished(_plan(tmp_path / "absent", str(tmp_path / "absent.yaml")), timeout=120)
    assert proc.returncode == 2 and "absent.yaml does not exist" in proc.stderr
    proc = _finished(_plan(tmp_path / "no_data", str(recipe), f"dataset_dir={tmp_path / 'no_data'}"),
                     timeout=120)
    assert proc.returncode == 2 and "no_data is not a directory" in proc.stderr


def test_model_spec_counts_the_benchmarks_8b_numbers():
    """Counted on the meta device from an 8B-shaped Qwen3-VL config, the step model's
    architecture numbers are the benchmark's 8B preset (derived there by hand from the shapes)."""
    from transformers import Qwen3VLConfig

    from odb_factory.dry_run.speedup import model_spec
    from odb_factory.simulation.step_model import QWEN3_VL_8B
    config = Qwen3VLConfig(
        text_config=dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, out_hidden_size=4096,
                           num_heads=16),
        tie_word_embeddings=False)
    spec = model_spec(config)
    for field in ("total_params", "llm_params", "llm_compute_params", "lora_params"):
        assert getattr(spec, field) == pytest.approx(getattr(QWEN3_VL_8B, field), rel=5e-3), field
    for field in ("llm_layers", "hidden", "attn_dim", "vocab", "vision_layers", "vision_width"):
        assert getattr(spec, field) == getattr(QWEN3_VL_8B, field), field


def test_the_dry_run_plans_beside_an_existing_output_dir(tiny_model, demo_data, tmp_path):
    """A recipe whose output_dir holds an earlier run (and no overwrite_output_dir) is planned:
    the dry run writes nothing there, so LLaMA-Factory's refusal to overwrite does not apply."""
    from odb_factory.dry_run.recipe import parse
    config = base_yaml(tiny_model, demo_data, tmp_path / "out", odb_enable=True)
    del config["overwrite_output_dir"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"")  # what LLaMA-Factory looks for
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    recipe = parse(path)
    assert recipe.odb_enabled and list((tmp_path / "out").iterdir()) == [tmp_path / "out" / "model.safetensors"]
