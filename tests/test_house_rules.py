"""The house rules of docs/architecture.md that are not about imports (those are tests/test_imports.py's), read
from the source: trainer/'s root holds its entry points and errors only; the Client and the backend all launchers
share compare no launcher's name (the Client delegates each verb to the launcher's backend, which declares it;
trainer/ names none at all: test_imports.py)."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
LAUNCHER_NAMES = {"local", "docker", "kubernetes"}


def test_trainers_root_holds_its_entry_points_and_errors_only():
    root = sorted(p.name for p in (REPO / "trainer").glob("*.py"))
    assert root == ["__init__.py", "__main__.py", "errors.py", "export.py", "worker.py"]


def _launcher_names_compared(source: str) -> list[int]:
    """The line of each comparison in `source` whose other side is a launcher's name (`x == "docker"`,
    `x in ("local", "docker")`), and of each `match` case on one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides, line = [node.left, *node.comparators], node.lineno
        elif isinstance(node, ast.match_case):
            sides, line = [node.pattern], node.pattern.lineno
        else:
            continue
        if {n.value for side in sides for n in ast.walk(side) if isinstance(n, ast.Constant)} & LAUNCHER_NAMES:
            found.append(line)
    return found


def test_no_launcher_name_is_compared_in_the_client_or_the_shared_backend():
    paths = [REPO / "launchers" / "client.py", REPO / "launchers" / "backend.py"]
    assert [f"{p.relative_to(REPO)}:{line}" for p in paths for line in _launcher_names_compared(p.read_text())] == []


def test_the_comparison_finder_finds_comparisons_and_passes_a_plain_use():
    assert _launcher_names_compared('if launcher == "docker" or name in ("local", "x"):\n    pass\n') == [1, 1]
    assert _launcher_names_compared('match name:\n    case "kubernetes":\n        pass\n') == [2]
    assert _launcher_names_compared('Client("kubernetes")\nif count == 2:\n    pass\n') == []
