"""The commands the documents show compose: every `python -m trainer ...` line in the code blocks of README.md
and docs/*.md names groups, options and keys that exist, with values of the schema's types (a sweep's first
point; a search space such as Optuna's interval is left to its sweeper). What the commands then need (a model
directory, a cluster, a GPU) is not here; the suite runs their kinds end to end elsewhere."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from trainer.config.compose import compose

REPO = pathlib.Path(__file__).resolve().parent.parent
COMMAND = re.compile(r"(?:^|\s)python -m trainer\s(.*)$")
INLINE = re.compile(r"`python -m trainer\s([^`]*)`")


def _commands() -> list[tuple[str, list[str]]]:
    """(file:line, the command's arguments) of every `python -m trainer` command the documents show: in a
    fenced or indented code block (continued lines joined), or inline in backquotes."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        fence, held = False, ""
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(REPO)}:{number}"
            if line.lstrip().startswith("```"):
                fence = not fence
                continue
            if not (fence or line.startswith("    ") or held):
                found += [(where, shlex.split(m)) for m in INLINE.findall(line)]
                continue
            if line.lstrip().startswith("#"):
                continue
            line = held + re.split(r"\s#\s", line)[0].strip()
            held = line[:-1] + " " if line.endswith("\\") else ""
            match = None if held else COMMAND.search(line)
            if match:
                found.append((where, shlex.split(match.group(1))))
    return found


def _first_point(args: list[str]) -> list[str]:
    """A sweep's first point as plain overrides; Hydra's own settings, search spaces and placeholders left out."""
    parser, point = OverridesParser.create(), []
    for arg in args:
        if arg.startswith("-") or "=" not in arg or "<" in arg:  # a flag, prose (...), a placeholder (<a path>)
            continue
        override = parser.parse_override(arg)
        if override.key_or_group.startswith("hydra") or override.key_or_group.startswith("hydra/"):
            continue
        if override.is_sweep_override():
            if override.is_interval_sweep():
                continue
            value = next(iter(override.sweep_string_iterator()))
            arg = f"{override.get_key_element()}={value}"
        point.append(arg)
    return point


def test_the_reader_finds_the_documents_commands_continued_lines_and_sweeps_included():
    commands = {where.split(":")[0]: args for where, args in _commands()}
    assert {"README.md", "docs/clusters.md", "docs/fine-tuning.md", "docs/tracking.md"} <= set(commands)
    args = [a for _, a in _commands()]
    assert ["-m", "optim.lr=1e-3,3e-4", "train.max_steps=50"] in args
    assert any("launcher=kubernetes" in a and "launcher.dry_run=true" in a for a in args)
    assert _first_point(["-m", "optim.lr=1e-3,3e-4", "strategy=ddp,fsdp2", "hydra.sweeper.n_jobs=1"]) == [
        "optim.lr=0.001", "strategy=ddp"]


@pytest.mark.parametrize(("where", "args"), _commands(), ids=[w for w, _ in _commands()])
def test_every_documented_command_composes(where, args):
    cfg = compose(_first_point(args))
    assert cfg.model.name and cfg.launcher.name, where
