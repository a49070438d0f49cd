"""trainjob.files: whether a directory can be made and written at a path is told without making anything, and a
file written whole is whole or not there."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import examples
from trainjob.files import directory_problem, write_whole

LAYOUT = st.lists(st.sampled_from(["d", "f"]), min_size=1, max_size=4)


@settings(max_examples=examples(30), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=LAYOUT, below=st.integers(0, 2))
def test_a_path_is_refused_exactly_when_a_file_is_in_its_way_and_nothing_is_made(tmp_path_factory, layout,
                                                                                 below):
    root = tmp_path_factory.mktemp("layout")
    path = root
    for i, kind in enumerate(layout):  # folders, and from the first "f" on, a file in the way
        path = path / f"p{i}"
        if kind == "f":
            path.write_text("x")
            break
        path.mkdir()
    target = path.joinpath(*[f"new{i}" for i in range(below)])
    before = sorted(root.rglob("*"))
    problem = directory_problem(str(target))
    assert sorted(root.rglob("*")) == before
    if "f" not in layout:
        assert problem is None
    elif below == 0:
        assert problem == "is a file"
    else:
        assert problem == f"is inside {path}, which is a file"


def test_write_whole_leaves_the_old_file_and_no_temporary_when_it_fails(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old")

    with pytest.raises(TypeError):
        write_whole(str(target), 123)  # a write that fails midway: not text
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["summary.json"]
