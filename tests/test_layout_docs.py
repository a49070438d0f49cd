"""The documents name the layout as it is: docs/architecture.md's table row of `trainer/` names every module of
it, the document names every folder of `trainer/` and `launchers/`, and docs/reference.md is the reference
the schema makes (`python -m trainer.config.reference`)."""

from __future__ import annotations

import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def _trainer_row() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `trainer/` |")]
    assert len(rows) == 1
    return rows[0]


def test_the_architecture_table_names_every_module_of_trainer():
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


def test_the_config_reference_is_what_the_schema_makes():
    from trainer.config import reference

    page = reference.markdown()
    assert (REPO / "docs" / "reference.md").read_text() == page, (
        "docs/reference.md is stale: python -m trainer.config.reference > docs/reference.md")
    for key in ("model.head_dim", "data.cache.endpoints", "launcher.namespace", "recipe.generation.async",
                "runtime.nproc_per_node", "tracker.wandb.mode", "lr_schedule.warmup_steps"):
        assert f"| `{key}` |" in page, key
    # Every key says what it sets (its schema's comment): an empty cell is a field to comment.
    rows = [line.split(" | ") for line in page.splitlines() if line.startswith("| `")]
    assert [row[0] for row in rows if not row[-1].rstrip("|").strip()] == []
    assert "| `data.path` |" in page and "(read by data=parquet, chat, preference, prompts only)" in page


def test_conf_names_the_module_that_reads_each_group():
    """A newcomer reading conf/config.yaml finds, beside each group of the defaults list, the module whose schema
    reads it; every group folder is in that list, and every module named there exists."""
    import re

    lines = (REPO / "conf" / "config.yaml").read_text().split("defaults:")[1].split("\n\n")[0].splitlines()
    entries = {}
    for line in lines:
        match = re.match(r"\s+- (\w+)(?::\s*\S+)?\s+# ([^\s:]+)", line)
        if match:
            entries[match.group(1)] = match.group(2)
    # experiment: whole presets; hydra: options of Hydra's own groups (hydra/sweeper=optuna), not the job's.
    groups = {p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name not in ("experiment", "hydra")}
    assert groups <= set(entries), sorted(groups - set(entries))
    for group, module in entries.items():
        path = REPO / module.replace("<name>", "local")
        assert path.exists(), (group, module)


def test_train_default_shows_every_key_of_the_train_section_at_the_schemas_default():
    """conf/train/default.yaml holds the loop's values for a newcomer to read; they are TrainConfig's defaults
    (the schema), key for key, so that the file never says other than what a run takes."""
    import dataclasses

    import yaml

    from trainer.config.train import TrainConfig

    shown = yaml.safe_load((REPO / "conf" / "train" / "default.yaml").read_text())
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert shown == defaults
