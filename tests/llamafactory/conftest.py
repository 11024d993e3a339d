"""Data sets the stage tests share: the shared LLaMA-Factory demo file read in place as
documents (stage pt) and as preference pairs (stage dpo)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import lf_runs


@pytest.fixture(scope="session")
def pt_data(tmp_path_factory):
    """Alpaca's answers as documents (the shared demo file, read in place)."""
    if not lf_runs.SHARED_DEMO.exists():
        pytest.skip("shared LLaMA-Factory demo data is absent")
    data = tmp_path_factory.mktemp("pt_data")
    (data / "dataset_info.json").write_text(json.dumps({"docs": {
        "file_name": str(lf_runs.SHARED_DEMO / "alpaca_en_demo.json"), "columns": {"prompt": "output"}}}))
    return data


@pytest.fixture(scope="session")
def pair_data(tmp_path_factory):
    """Preference pairs over the shared alpaca demo file, read in place: the answer is chosen,
    the instruction echoed back is rejected."""
    if not lf_runs.SHARED_DEMO.exists():
        pytest.skip("shared LLaMA-Factory demo data is absent")
    data = tmp_path_factory.mktemp("pair_data")
    (data / "dataset_info.json").write_text(json.dumps({"pairs": {
        "file_name": str(lf_runs.SHARED_DEMO / "alpaca_en_demo.json"), "ranking": True,
        "columns": {"prompt": "instruction", "query": "input", "chosen": "output", "rejected": "instruction"}}}))
    return data
