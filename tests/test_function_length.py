"""No function of the project (tests included) runs over 60 lines, Triton kernels (`@triton.jit`) aside:
read from the source, nothing imported."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("trainjob", "trainer", "launchers", "datacache", "ops", "bench", "tests")
LIMIT = 60


def too_long(source: str) -> list[tuple[str, int]]:
    """(name, lines) of each function in `source` over LIMIT lines that is not a kernel."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kernel = any("jit" in ast.unparse(d) for d in node.decorator_list)
            lines = node.end_lineno - node.lineno + 1
            if lines > LIMIT and not kernel:
                found.append((node.name, lines))
    return found


def test_the_measure_counts_a_function_from_def_to_its_last_line_and_spares_kernels():
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMIT))
    assert too_long(f"def f():\n{body}") == [("f", LIMIT + 1)]
    assert too_long(f"@triton.jit\ndef k():\n{body}") == []
    assert too_long(f"def g():\n{body[: -len('    x59 = 59') - 1]}") == []


def test_no_function_runs_over_60_lines():
    found = {f"{path.relative_to(REPO)}:{name}": lines for folder in FOLDERS
             for path in sorted((REPO / folder).rglob("*.py")) for name, lines in too_long(path.read_text())}
    assert found == {}
