"""The settings reference: docs/configuration.md is what the generator prints, and says something
about every setting."""

from __future__ import annotations

from pathlib import Path

from tracon_jobs.settings.reference import REGENERATE, reference_rows, render_reference

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_docs_configuration_md_is_what_the_generator_prints() -> None:
    written = REFERENCE.read_text(encoding="utf-8") if REFERENCE.is_file() else ""
    assert written == render_reference(), (
        f"{REFERENCE} is out of date with the settings models and defaults; regenerate it "
        f"from the repository root with `{REGENERATE}` and commit the result"
    )


def test_every_setting_has_a_description() -> None:
    rows = reference_rows()
    assert rows
    undescribed = [":".join(row.path) for row in rows if not row.description]
    assert not undescribed, (
        f"add a `description=` to these fields (or a default docstring): {undescribed}"
    )
