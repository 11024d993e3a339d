"""A schedule's attention is priced as the attention that runs computes it: padded batches
n · max_len², packed rows Σ len² per sample (flash varlen, per-segment sdpa) or (Σ len)²
through transformers' dense block mask; a dpo pair's two rows attend apart."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from odb_factory.simulation.pricing import features
from odb_factory.simulation.schedules import Schedule


def _samples(lengths):
    zeros = np.zeros(len(lengths))
    return SimpleNamespace(tokens=np.asarray(lengths, dtype=np.int64), images=zeros, patches=zeros, patch_sq=zeros)


def test_attention_by_cost_mode_and_packed_attention():
    lengths = [3, 5, 10, 2]
    steps = [[np.array([0, 1]), np.array([2])], [np.array([3]), np.array([], dtype=np.int64)]]
    samples = _samples(lengths)
    padded = features(Schedule("padded", 2, steps, cost_mode="padded"), samples)
    assert padded.attention_sq().tolist() == [[2 * 5 ** 2, 10 ** 2], [2 ** 2, 0]]
    segments = features(Schedule("packed", 2, steps, cost_mode="packed"), samples)
    assert segments.attention_sq().tolist() == [[3 ** 2 + 5 ** 2, 10 ** 2], [2 ** 2, 0]]
    mask = features(Schedule("packed", 2, steps, cost_mode="packed"), samples, packed_attention="mask")
    assert mask.attention_sq().tolist() == [[(3 + 5) ** 2, 10 ** 2], [2 ** 2, 0]]
    assert mask.padded().tolist() == segments.padded().tolist() == [[8, 10], [2, 0]]
    with pytest.raises(ValueError, match=r"packed_attention 'flex' is not one of \['segments', 'mask'\]"):
        features(Schedule("packed", 2, steps, cost_mode="packed"), samples, packed_attention="flex")


def test_a_dpo_pair_is_priced_as_its_two_rows_and_the_reference_forward():
    """A pair of cost l (two rows of l/2) attends within each row: a padded batch of n pairs
    counts n · max_len² / 2, alone l² / 2. The reference model adds one forward to every token
    and image, and, as a frozen copy, its bf16 weights to the memory."""
    from odb_factory.simulation.pricing import evaluate
    from odb_factory.simulation.step_model import H20_1NODE, QWEN3_VL_8B, build_step_model

    pairs = _samples([16, 32, 64])
    pairs.rows_per_sample = 2
    steps = [[np.array([0, 1])], [np.array([2])]]
    f = features(Schedule("pairs", 1, steps, cost_mode="padded"), pairs)
    assert f.padded().tolist() == [[2 * 32], [64]]          # 2n rows of the longer side's length
    assert f.attention_sq().tolist() == [[2 * 32 ** 2 / 2], [64 ** 2 / 2]]
    m = replace(build_step_model(QWEN3_VL_8B, H20_1NODE, "full"), world=1)
    result = evaluate(f, pairs, m)
    assert result.useful_s == pytest.approx(sum(m.a * n + m.b * n * n / 2 for n in (16, 32, 64)))

    plain, copy = (build_step_model(QWEN3_VL_8B, H20_1NODE, "full", reference_model=r) for r in ("none", "copy"))
    assert copy.a / plain.a == pytest.approx(5 / 4) and copy.b / plain.b == pytest.approx(5 / 4)  # fwd+bwd(2)+recompute
    assert copy.va / plain.va == pytest.approx(2)              # the frozen vision tower runs twice
    assert copy.static_bytes - plain.static_bytes == pytest.approx(2 * QWEN3_VL_8B.total_params)
    lora, shared = (build_step_model(QWEN3_VL_8B, H20_1NODE, "lora", reference_model=r) for r in ("none", "shared"))
    assert shared.a / lora.a == pytest.approx(4 / 3) and shared.static_bytes == lora.static_bytes
    with pytest.raises(ValueError, match="reference_model must be one of"):
        build_step_model(QWEN3_VL_8B, H20_1NODE, "full", reference_model="twin")


def test_a_recipe_predicted_slower_than_standard_names_the_faster_setting():
    """The dry run's warning. One rank, no fixed cost to save: Standard's batch 1 computes no
    padding, so padded `samples` groups of unequal rows are predicted slower and padding-free
    ones not; packed rows under the dense mask point to per-segment attention."""
    from odb_factory.config import ODBConfig
    from odb_factory.dry_run import report, speedup
    from odb_factory.dry_run.__main__ import faster_setting
    from odb_factory.dry_run.stages import stage_of
    from odb_factory.simulation.step_model import H20_1NODE, QWEN3_VL_8B, build_step_model

    tokens = np.random.default_rng(0).integers(500, 4000, 256)
    zeros, ones = np.zeros(len(tokens)), np.ones(len(tokens), dtype=bool)
    rows = report.Rows(tokens=tokens, label_tokens=tokens // 2, images=zeros, patches=zeros, patch_sq=zeros,
                       text_tokens=tokens, full_tokens=tokens, measured=ones)
    model = replace(build_step_model(QWEN3_VL_8B, H20_1NODE, "full"), c0=1e-4, idle_s=1e-4, comm_micro_s=0.0,
                    world=1)
    padded = ODBConfig(step_mode="samples", token_budget=16384, gradient_accumulation_steps=8, standard_batch_size=1,
                       pad_epoch_to_accumulation=True)
    packed = replace(padded, cost_mode="packed", balance_mode="lpt")

    def warning(cfg, attention, model_type="qwen3_vl", stage="sft"):
        schedules = report.mode_schedules(rows, cfg, 1)
        feats = {name: features(s, rows, attention) for name, s in schedules.items()}
        predicted = speedup.predicted(feats["standard"], {"samples": feats["samples"]}, rows, model)
        recipe = SimpleNamespace(packed_attention=attention, stage=stage_of(stage))
        return predicted["samples"]["speedup"], faster_setting(recipe, cfg, rows, schedules["standard"],
                                                               feats["standard"], predicted, model, 1, model_type)

    slower, found = warning(padded, "segments")
    assert slower < 0.9 and found["setting"] == "odb_padding_free: true"
    assert found["speedup"] == slower and found["setting_speedup"] == pytest.approx(1.0, abs=1e-3)
    assert warning(padded, "segments", model_type="gemma3")[1] is None   # padding-free is not verified there
    assert warning(padded, "segments", stage="dpo")[1] is None   # stage dpo trains padded rows only
    dense, found = warning(packed, "mask")
    assert dense < 0.9 and found["setting"] == "odb_packed_attention: segments"
    assert found["setting_speedup"] == pytest.approx(1.0, abs=1e-3)
    per_segment, found = warning(packed, "segments")
    assert per_segment == pytest.approx(1.0, abs=1e-3) and found is None
