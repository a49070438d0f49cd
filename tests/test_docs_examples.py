"""The commands the documents show run as written: every `python -m trainer ...` line in the code blocks of
README.md and docs/*.md names groups, options and keys that exist, with values of the schema's types, and only
keys its options read (a sweep's first point; a search space such as Optuna's interval is left to its sweeper);
each runs as `python -m trainer <its overrides> --cfg job` (a dry run, `launcher.dry_run=true`, runs whole, every
check included), exiting 0 unless its block is marked `<!-- shows an error -->` above its fence (then 2). What
the commands then need (a model directory, a cluster, a GPU) is not here; the suite runs their kinds end to end
elsewhere."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from trainer.config import readers
from trainer.config.compose import compose

REPO = pathlib.Path(__file__).resolve().parent.parent
COMMAND = re.compile(r"(?:^|\s)python -m trainer\s(.*)$")
INLINE = re.compile(r"`python -m trainer\s([^`]*)`")
SHOWS_ERROR = re.compile(r"<!--\s*shows an error\b")
ERRORS: set[str] = set()  # file:line of the commands in blocks marked as showing an error


def _commands() -> list[tuple[str, list[str]]]:
    """(file:line, the command's arguments) of every `python -m trainer` command the documents show: in a
    fenced or indented code block (continued lines joined), or inline in backquotes. Those of a fenced block
    marked `<!-- shows an error -->` go in ERRORS too."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        fence, held, above, error = False, "", "", False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(REPO)}:{number}"
            if line.lstrip().startswith("```"):
                fence = not fence
                error = fence and bool(SHOWS_ERROR.search(above))
                continue
            above = line if line.strip() else above
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
                if error:
                    ERRORS.add(where)
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
def test_every_documented_command_composes_and_sets_only_keys_its_options_read(where, args):
    point = _first_point(args)
    cfg = compose(point)
    assert cfg.model.name and cfg.launcher.name, where
    chosen = readers.chosen_by(point)
    assert [reason for key in readers.given_keys(point) if (reason := readers.unread(key, chosen))] == [], where


@pytest.fixture(scope="module")
def documented_runs(run_cli_batch, tmp_path_factory) -> dict[str, object]:
    """Each documented command run from one interpreter (tests/cli_batch.py), in a directory of its own: a dry run
    as written, any other as `--cfg job` (what it composes, nothing trained)."""
    commands = _commands()
    runs = []
    for _, args in commands:
        point = _first_point(args)
        dry = "launcher.dry_run=true" in point
        runs.append(([*point, *(() if dry else ("--cfg", "job"))], tmp_path_factory.mktemp("doc")))
    return {where: proc for (where, _), proc in zip(commands, run_cli_batch(runs, timeout=900), strict=True)}


@pytest.mark.parametrize("where", [w for w, _ in _commands()])
def test_every_documented_command_runs_as_written(documented_runs, where):
    proc = documented_runs[where]
    expected = 2 if where in ERRORS else 0
    assert proc.returncode == expected, f"{where}: {' '.join(proc.args[3:])}\n{proc.stderr[-2000:]}"
