"""What the LLaMA-Factory tests share: LLaMA-Factory's entry points with the patches applied
(`lf`), and the shared demo file read in place as documents (stage pt) and as preference pairs
(stage dpo)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import lf_runs


@pytest.fixture(scope="module")
def lf():
    """(get_train_args, load_tokenizer, get_template_and_fix_tokenizer, get_dataset), patched."""
    pytest.importorskip("llamafactory")
    import llamafactory.train.tuner  # noqa: F401  (the import hook applies the patches here)
    import odb_factory_patches
    odb_factory_patches.apply()
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer
    return get_train_args, load_tokenizer, get_template_and_fix_tokenizer, get_dataset


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
