"""docs/configuration.md is generated from shared/config.py's field comments and stays current.

Regenerate after changing a setting: ``python -m shared.config --markdown > docs/configuration.md``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from shared.config import SETTINGS_DOC, BatonConfig, settings_markdown
from shared.config_flags import field_sections, markdown_table

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_doc_is_current() -> None:
    current = (ROOT / SETTINGS_DOC).read_text()
    assert current == settings_markdown(), (
        f"{SETTINGS_DOC} is out of date: python -m shared.config --markdown > {SETTINGS_DOC}"
    )


def test_every_setting_has_a_row_with_its_variable_flag_and_help() -> None:
    table = markdown_table(BatonConfig)
    rows = {line.split(" | ")[0].strip("| `"): line for line in table.splitlines()}
    for f in dataclasses.fields(BatonConfig):
        row = rows[f"BATON_{f.name.upper()}"]
        assert f"`--{f.name.replace('_', '-')}" in row
        assert row.rstrip(" |").split(" | ")[-1], f"{f.name}: no help text"


def test_sections_follow_the_source() -> None:
    sections = field_sections(BatonConfig)
    assert sections["amqp_url"] == "broker"
    assert sections["api_key"] == "gateway"
    assert "(hidden)" in next(
        line for line in markdown_table(BatonConfig).splitlines() if "BATON_API_KEY" in line
    )
