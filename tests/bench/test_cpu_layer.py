"""bench.cpu_layer's inputs: the CV 1 cells' rows (real alpaca text, responses cut to the
cell's lognormal lengths) and the peers' keys (batch = accumulation, the length-grouped sampler)."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from bench import cpu_layer
from odb_factory.demo import tiny_qwen3


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return tiny_qwen3.build_tiny_qwen3(tmp_path_factory.mktemp("model") / "tiny_qwen3", seed=0)


def test_cv1_rows_are_alpaca_rows_cut_to_the_cells_lengths(tmp_path, monkeypatch, tokenizer_dir):
    from transformers import AutoTokenizer
    monkeypatch.setattr(cpu_layer, "RUNS", tmp_path)
    figures = cpu_layer.cut_rows("cv1_mean128_qwen_vocab", tokenizer_dir, 240)
    rows = json.loads((tmp_path / "data" / "cv1_mean128_qwen_vocab.json").read_text())
    source = json.loads((cpu_layer.DEMO / "alpaca_en_demo.json").read_text())
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    lengths = []
    for row in rows:
        whole = next(r for r in source if r["instruction"] == row["instruction"] and r["input"] == row["input"])
        assert whole["output"].startswith(row["output"].strip()[:20])      # a cut of the real response
        lengths.append(len(tok(row["instruction"] + row["input"])["input_ids"]) + len(tok(row["output"])["input_ids"]))
    assert len(rows) == 240
    mean, cv = statistics.mean(lengths), statistics.pstdev(lengths) / statistics.mean(lengths)
    assert 0.8 * 128 <= mean <= 1.2 * 128 and 0.8 <= cv <= 1.2
    assert figures["mean"] == pytest.approx(mean, rel=0.05) and figures["cv"] == pytest.approx(cv, abs=0.1)
    info = json.loads((tmp_path / "data" / "dataset_info.json").read_text())
    assert info["cv1_mean128_qwen_vocab"]["file_name"].endswith("cv1_mean128_qwen_vocab.json")


@pytest.mark.parametrize("method", ["standard_batch", "standard_by_length"])
def test_the_batched_peers_train_a_step_as_one_micro_batch(tmp_path, monkeypatch, method):
    monkeypatch.setattr(cpu_layer, "RUNS", tmp_path)
    keys = cpu_layer.config(method, tmp_path, 128, 40, 8, tmp_path / "out")
    assert (keys["per_device_train_batch_size"], keys["gradient_accumulation_steps"]) == (8, 1)
    assert (keys.get("train_sampling_strategy") == "group_by_length") == (method == "standard_by_length")
    odb = cpu_layer.config("odb_groups", tmp_path, 128, 40, 8, tmp_path / "out", dataset="cv1_mean128_qwen_vocab")
    assert (odb["per_device_train_batch_size"], odb["gradient_accumulation_steps"]) == (1, 8)
    assert odb["odb_step"] == "groups" and odb["dataset"] == "cv1_mean128_qwen_vocab"


def test_the_fit_prices_short_rows_beside_long_ones():
    """Steps of two data sets that the model's form fits only approximately: a few of short
    rows (8 micro-batches of ~50 tokens, a fixed cost per micro-batch) and many of long rows
    whose cost per token grows a little with the step. Fitted on relative error, the fixed
    cost is found and the short steps are priced within 1%; a least-squares fit on seconds
    spends everything on the long rows' tokens (no fixed cost) and misprices them by 5%."""
    steps = []
    for i in range(4):
        tokens = 400 + 20 * i
        steps.append({"micro_batches": 8, "tokens": tokens, "sum_sq": tokens * 50, "logit_tokens": tokens,
                      "time_s": 0.3 * 8 + 2e-3 * tokens})
    for i in range(24):
        tokens = 6000 + 150 * i
        steps.append({"micro_batches": 1 + i % 3, "tokens": tokens, "sum_sq": tokens * 500, "logit_tokens": tokens,
                      "time_s": 1e-2 * tokens * (1 + 1e-5 * tokens)})
    coef = cpu_layer.fit_coefficients(steps)
    priced = [float(np.dot(coef, [s[k] for k in cpu_layer.COLUMNS])) / s["time_s"] - 1 for s in steps]
    assert coef[0] == pytest.approx(0.3, rel=0.1)
    assert max(abs(e) for e in priced[:4]) < 0.01
    assert max(abs(e) for e in priced[4:]) < 0.02
    on_seconds = cpu_layer.fit_coefficients(steps, relative=False)
    assert on_seconds[0] == 0.0 and float(np.dot(on_seconds, [steps[0][k] for k in cpu_layer.COLUMNS])) \
        < 0.95 * steps[0]["time_s"]


def test_a_fit_written_for_the_dry_run_reads_back_and_recovers_its_coefficients(tmp_path):
    """Optimizer steps made from known coefficients are fitted back exactly, and the file
    `--fit-out` writes is the measured step model the dry run reads."""
    from odb_factory.simulation.measured import measured_step_model
    truth = {"micro_batches": 0.3, "tokens": 2e-3, "sum_sq": 4e-7, "logit_tokens": 5e-3}
    steps = []
    for i in range(12):
        step = {"micro_batches": 1 + i % 4, "tokens": 200 + 97 * i, "sum_sq": (200 + 97 * i) * (60 + 13 * (i % 5)),
                "logit_tokens": 150 + 41 * (i % 7)}
        steps.append(dict(step, time_s=sum(truth[k] * step[k] for k in cpu_layer.COLUMNS)))
    coef = cpu_layer.fit_coefficients(steps)
    assert coef == pytest.approx([truth[k] for k in cpu_layer.COLUMNS], rel=1e-6)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(cpu_layer.step_model_json(coef, cpu_layer.RANKS, ["runs"])))
    m = measured_step_model(path, cpu_layer.RANKS)
    assert (m.c0, m.a, m.b, m.head) == pytest.approx([truth[k] for k in cpu_layer.COLUMNS], rel=1e-6)
    assert m.ranks_meet == "optimizer_step" and m.device == "cpu"
