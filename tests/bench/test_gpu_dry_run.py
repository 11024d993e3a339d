"""bench.gpu's CPU dry run (tiny Qwen3-VL, float32): the script the GPU machine runs, end to end,
and its padding-free collate against the padded batch in float64."""

from __future__ import annotations

import csv

import pytest
import torch

pytest.importorskip("transformers")

from bench import gpu  # noqa: E402
from odb_factory.loss import token_mean_loss  # noqa: E402


def _csv(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_dry_run_times_the_grid_fits_and_trains_every_method(tmp_path):
    res = gpu.run(tmp_path, dry_run=True, budget_s=600, samples=24, profiles=["LLaVA-Instruct-150K"],
                  mfu=0.825, log=lambda msg: None)
    steps = _csv(tmp_path / "gpu_steps.csv")
    assert len(steps) == 8 and all(float(r["time_s"]) > 0 for r in steps)
    assert {r["patches_per_row"] for r in steps} == {"0", "16"}
    assert [r["coefficient"] for r in _csv(tmp_path / "gpu_coefficients.csv")] == \
        ["c0", "tokens", "sum_sq", "images", "patches", "patch_sq"]
    runs = {r["method"]: r for r in res["throughput"]}
    assert list(runs) == ["Standard bs=1", "ODB samples", "ODB groups", "ODB samples padding-free"]
    assert all(r["samples"] == 24 and r["samples_per_s"] > 0 for r in runs.values())  # each checked once-only
    # samples mode keeps the fixed-batch run's optimizer steps (batch 1, accumulation 4)
    assert runs["Standard bs=1"]["optimizer_steps"] == runs["ODB samples"]["optimizer_steps"] == \
        runs["ODB samples padding-free"]["optimizer_steps"] == 6
    assert len(_csv(tmp_path / "gpu_throughput.csv")) == 4
    assert "synthetic inputs" in (tmp_path / "gpu_report.md").read_text()


def test_packed_row_has_the_padded_batch_loss():
    model = gpu.build_model(gpu.TINY_SHAPES, "cpu", torch.float64, "sdpa")
    model.gradient_checkpointing_disable()
    data = gpu.SyntheticVLSamples(gpu.TINY_SHAPES, [40, 90, 25], [1, 0, 2], [36, 0, 40])
    samples = [data[i] for i in range(3)]
    padded = gpu.pad_collate(samples, gpu.TINY_SHAPES.image_token)
    packed = gpu.PackedRopeCollate(model, gpu.TINY_SHAPES)(samples)
    assert packed["input_ids"].shape[0] == 1
    assert "attention_mask" not in packed and packed["position_ids"].shape[:2] == (4, 1)
    def loss(batch):  # in float64 (transformers' own loss upcasts to float32 only)
        labels = batch.pop("labels")
        with torch.no_grad():
            return token_mean_loss(model(**batch).logits, labels).item()
    assert loss(packed) == pytest.approx(loss(padded), rel=1e-12)
