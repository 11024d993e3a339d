"""The option tables of docs/configuration.md are generated from the declarations and must not drift."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from odb_factory import ODBConfig, options_table

CONFIGURATION = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_tables_match_the_declarations():
    text = CONFIGURATION.read_text()
    assert options_table.render(text) == text, (
        "docs/configuration.md option tables are out of date: "
        "run python -m odb_factory.options_table docs/configuration.md")


def test_every_option_appears_in_the_reference():
    table = options_table.config_reference_table()
    for f in dataclasses.fields(ODBConfig):
        assert f"| `{f.name}` |" in table
    keys = options_table.yaml_keys_table()
    for key in ("odb_enable", "odb_token_budget", "odb_collate_workers", "odb_sync_timeout"):
        assert f"| `{key}` |" in keys


def test_a_changed_declaration_makes_the_check_fail(tmp_path):
    stale = CONFIGURATION.read_text().replace("| `token_budget` | 4096 |", "| `token_budget` | 1 |")
    assert stale != CONFIGURATION.read_text()
    path = tmp_path / "configuration.md"
    path.write_text(stale)
    assert options_table.main([str(path), "--check"]) == 1
    assert options_table.main([str(path)]) == 0 and options_table.main([str(path), "--check"]) == 0
