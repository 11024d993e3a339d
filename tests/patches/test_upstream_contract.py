"""The upstream contract (patches/odb_factory_patches/upstream_contract.py): it holds on the
pinned versions, the checker does report a broken entry, a broken contract refuses the
patches, and docs/upstream_contract.md shows the module's table."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("llamafactory")

from odb_factory_patches import upstream_contract as uc

REPO = Path(__file__).resolve().parents[2]


def test_contract_holds_on_the_installed_versions():
    violations = uc.check(deep=True)
    assert not violations, "the upstream contract is broken:\n" + "\n".join(violations)


def test_every_entry_names_a_project_file_and_a_gate():
    for entry in uc.CONTRACT:
        assert (REPO / entry.used_by).is_file(), entry
        assert entry.gate in uc.GATES and entry.why and ":" in entry.target, entry


@pytest.fixture
def fake_module(monkeypatch):
    @dataclasses.dataclass
    class Record:
        kept: int = 0

    def two(a, b):
        return a + b

    def reads_nothing():
        return None

    mod = types.ModuleType("odb_contract_fake")
    mod.Record, mod.two, mod.reads_nothing, mod.LIMIT = Record, two, reads_nothing, 3
    monkeypatch.setitem(sys.modules, "odb_contract_fake", mod)
    return mod


def _entry(target, **kwargs):
    return uc.Entry("torch", f"odb_contract_fake:{target}", "tests/patches/test_upstream_contract.py",
                    "a fake entry", **kwargs)


def test_the_checker_reports_each_kind_of_violation(fake_module):
    import torch
    broken = [_entry("gone", params=("a",)),
              _entry("two", params=("a", "c")),
              _entry("reads_nothing", uses=("_iterator",)),
              _entry("Record", fields=("kept", "dropped")),
              _entry("two", fields=("a",)),
              _entry("LIMIT", value=4),
              _entry("two", probe=lambda: "behaves differently")]
    violations = uc.check(broken, deep=True)
    expected = ["odb_contract_fake.gone is missing", "parameters changed: expected (a, c), found (a, b)",
                "no longer uses _iterator", "lacks the fields dropped", "is no longer a dataclass",
                "is 3, expected 4", "behaves differently"]
    assert len(violations) == len(expected), violations
    for line, text in zip(violations, expected):
        assert text in line and line.startswith(f"torch {torch.__version__}: "), line
        assert "[tests/patches/test_upstream_contract.py: a fake entry]" in line
    # the probe runs only when asked for; the same entries as they are pass
    assert len(uc.check(broken)) == len(expected) - 1
    holds = [_entry("two", params=("a", "b")), _entry("Record", fields=("kept",)), _entry("LIMIT", value=3)]
    assert uc.check(holds, deep=True) == []


def test_an_entry_is_checked_only_on_the_versions_it_names(fake_module):
    import torch
    installed = torch.__version__.split("+")[0]
    inside = _entry("gone", params=("a",), versions=(installed, installed))
    outside = _entry("gone", params=("a",), versions=("0.0.1", "0.0.9"))
    assert [v.split(": ", 1)[1] for v in uc.check([inside, outside])] == [
        "odb_contract_fake.gone is missing (AttributeError: module 'odb_contract_fake' has no attribute "
        "'gone') [tests/patches/test_upstream_contract.py: a fake entry]"]
    # the docs table names each entry's versions
    assert "| 5.0.0–5.6.0 |" in uc.markdown_table() and "| 4.57.1–4.57.6 |" in uc.markdown_table()


def test_a_private_torch_symbol_going_missing_is_named(monkeypatch):
    import torch
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    monkeypatch.delattr(_MultiProcessingDataLoaderIter, "_shutdown_workers")
    reason = uc.reason(gates=("odb",))
    assert reason is not None and f"torch {torch.__version__}" in reason
    assert "_MultiProcessingDataLoaderIter._shutdown_workers is missing" in reason
    assert "odb_factory/loader/loader.py" in reason


def test_apply_refuses_a_broken_contract_like_an_unsupported_version(monkeypatch, caplog):
    import odb_factory_patches
    from odb_factory_patches import (
        llamafactory_data_loader,
        llamafactory_hparams_parser,
        llamafactory_sft_workflow,
    )
    from transformers.trainer import Trainer
    calls = {}
    monkeypatch.setattr(odb_factory_patches, "_applied", False)
    monkeypatch.setattr(llamafactory_hparams_parser, "apply", lambda unsupported=None: calls.update(guard=unsupported))
    monkeypatch.setattr(llamafactory_data_loader, "apply", lambda: calls.update(data=True))
    monkeypatch.setattr(llamafactory_sft_workflow, "apply", lambda: calls.update(sft=True))
    monkeypatch.delattr(Trainer, "get_batch_samples")
    with caplog.at_level(logging.WARNING, logger="odb_factory"):
        odb_factory_patches.apply()
    assert set(calls) == {"guard"}, calls
    assert "Trainer.get_batch_samples is missing" in calls["guard"]
    assert "odb-factory patches not applied" in caplog.text and "get_batch_samples" in caplog.text


@pytest.mark.parametrize("version,installed", [("2.14.1", True), ("2.15.0", False)])
def test_the_cpu_resume_fix_is_version_gated(monkeypatch, caplog, version, installed):
    import odb_factory_patches
    import torch
    from odb_factory_patches import (
        llamafactory_data_loader,
        llamafactory_hparams_parser,
        llamafactory_sft_workflow,
        torch_serialization,
    )
    calls = []
    monkeypatch.setattr(odb_factory_patches, "_applied", False)
    for module in (llamafactory_data_loader, llamafactory_sft_workflow):
        monkeypatch.setattr(module, "apply", lambda: None)
    monkeypatch.setattr(llamafactory_hparams_parser, "apply", lambda unsupported=None: None)
    monkeypatch.setattr(torch_serialization, "apply", lambda: calls.append("cpu_resume"))
    monkeypatch.setattr(torch, "__version__", version)
    with caplog.at_level(logging.WARNING, logger="odb_factory"):
        odb_factory_patches.apply()
    assert calls == (["cpu_resume"] if installed else [])
    if not installed:
        assert "CPU-resume fix (torch_serialization) is not installed" in caplog.text
        assert f"torch {version} is installed" in caplog.text


def _ldr(num_workers=1):
    from odb_factory import ODBConfig, ODBDataLoader
    from odb_factory.synthetic import LengthDataset
    return ODBDataLoader(LengthDataset([10] * 8), ODBConfig(token_budget=100), num_workers=num_workers)


def test_close_raises_when_torch_lacks_what_it_relies_on(monkeypatch):
    import torch
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    loader = _ldr()
    try:
        with monkeypatch.context() as m:
            m.delattr(_MultiProcessingDataLoaderIter, "_shutdown_workers")
            with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} has no "
                                                             "_MultiProcessingDataLoaderIter._shutdown_workers")):
                loader.close()
        iterator = loader._sample_loader._iterator
        del loader._sample_loader._iterator
        with pytest.raises(RuntimeError, match=r"has no DataLoader\._iterator"):
            loader.close()
        loader._sample_loader._iterator = iterator
    finally:
        loader.close()
    assert loader._sample_loader._iterator is None


def test_the_docs_table_is_the_modules():
    text = (REPO / "docs" / "upstream_contract.md").read_text()
    start, end = "<!-- contract-table:start -->\n", "\n<!-- contract-table:end -->"
    assert start in text and end in text, "docs/upstream_contract.md lost its table markers"
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == uc.markdown_table(), (
        "docs/upstream_contract.md is out of date: replace its table with the output of "
        "`python -m odb_factory_patches.upstream_contract --table`")
