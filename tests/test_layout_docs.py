"""The documents name the layout as it is: the README's table row of `trainer/` names every module of it,
and docs/architecture.md names every folder of `trainer/` and `launchers/`."""

from __future__ import annotations

import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def _trainer_row() -> str:
    rows = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `trainer/` |")]
    assert len(rows) == 1
    return rows[0]


def test_the_readme_table_names_every_module_of_trainer():
    row = _trainer_row()
    missing = sorted(str(p.relative_to(REPO / "trainer")) for p in (REPO / "trainer").rglob("*.py")
                     if p.name != "__init__.py" and f"`{p.name}`" not in row)
    assert missing == []
    folders = sorted(p.name for p in (REPO / "trainer").iterdir() if (p / "__init__.py").is_file())
    assert [f for f in folders if f"`{f}/`" not in row] == []


def test_the_architecture_document_names_every_folder():
    text = (REPO / "docs" / "architecture.md").read_text()
    for package in ("trainer", "launchers"):
        folders = [p.name for p in (REPO / package).iterdir() if (p / "__init__.py").is_file()]
        assert [f for f in folders if f"{f}/" not in text] == [], package
