"""End-to-end: LLaMA-Factory training (lf_runs.train) on a tiny Qwen2.5-VL (template qwen2_vl) with odb_* keys."""

from __future__ import annotations

import pytest
from tests.helpers.lf_runs import base_yaml, ledger, log_history, train, trained_indices

pytest.importorskip("llamafactory")
NUM_SAMPLES = 96  # conftest.demo_data

# groups mode: these tests check the paper's batching (coverage ledgers, exact global token mean)
ODB = {"odb_enable": True, "odb_step": "groups", "odb_loss_scaling": "exact", "odb_token_budget": 768,
       "odb_buffer_size": 32, "odb_collate_workers": 1}


@pytest.fixture(scope="module")
def tiny_qwen25vl(tmp_path_factory):
    from odb_factory.demo.tiny_qwen25vl import build_tiny_qwen25vl
    return build_tiny_qwen25vl(tmp_path_factory.mktemp("models") / "tiny_qwen25vl", seed=0)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, tiny_qwen25vl, demo_data):
    """One 2-rank ODB run (one epoch over the 96 demo samples), shared by the tests below."""
    root = tmp_path_factory.mktemp("qwen25vl_ddp")
    out, audit = root / "out", root / "audit"
    config = base_yaml(tiny_qwen25vl, demo_data, out, template="qwen2_vl", odb_audit_dir=str(audit), **ODB)
    train(config, nproc=2)
    return out, ledger(audit)


def test_builder_is_idempotent_and_ids_match(tiny_qwen25vl):
    import json

    from odb_factory.demo.tiny_qwen25vl import build_tiny_qwen25vl

    marker = (tiny_qwen25vl / "odb_tiny_build.json").read_text()
    assert build_tiny_qwen25vl(tiny_qwen25vl, seed=0) == tiny_qwen25vl
    assert (tiny_qwen25vl / "odb_tiny_build.json").read_text() == marker, "a complete build is reused"
    config = json.loads((tiny_qwen25vl / "config.json").read_text())
    ids = json.loads(marker)["token_ids"]
    assert config["model_type"] == "qwen2_5_vl"
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_start_token_id"] == ids["<|vision_start|>"]
    assert config["vision_end_token_id"] == ids["<|vision_end|>"]
    assert config["vision_config"]["out_hidden_size"] == config["text_config"]["hidden_size"] == 64


def test_two_ranks_ledger_covers_every_index_once(ddp_run):
    _, rows = ddp_run
    steps = {rank: [r["step"] for r in rows if r["rank"] == rank] for rank in (0, 1)}
    assert steps[0] and steps[0] == steps[1], "both ranks ran the same optimizer steps"
    assert trained_indices(rows) == list(range(NUM_SAMPLES))


def test_input_tokens_and_padding_efficiency_logged(ddp_run):
    out, rows = ddp_run
    for step in sorted({r["step"] for r in rows}):
        assert sum(r["input_tokens"] for r in rows if r["step"] == step) > 0, f"step {step} trained no tokens"
    assert all(0 < r["input_tokens"] <= r["padded_tokens"] for r in rows if r["indices"])
    history = [h for h in log_history(out) if "loss" in h]
    assert history and all(0 < h["odb/padding_efficiency"] <= 1 for h in history)
