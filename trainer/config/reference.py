"""The reference of every config key, made from the schema itself: for each section, the options of its group
(`conf/<group>/*.yaml`) and a table of its keys (nested sections' keys dotted), with each key's type, the
schema's default and the comment written beside its field (with the options that read it, where only some do:
`trainer.config.readers`). `python -m trainer.config.reference` prints it;
docs/reference.md is that output, and a test holds the file to it, so the reference is never stale."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from functools import cache

from omegaconf import MISSING

from launchers import LAUNCHER_SCHEMAS, SchedulerConfig
from trainer.config import readers
from trainer.config.schema import Config
from trainjob import runtimes

HEADER = """# Config reference

Every key `python -m trainer` takes, section by section, made from the schema (`trainer/config/`,
`launchers/`) by `python -m trainer.config.reference`; a test keeps this page equal to its output. A group's
option (`conf/<group>/<option>.yaml`) may set other values than the schema's defaults shown here: `python -m
trainer <group>=<option> --cfg job` prints what a composition holds. A key only some options read says which;
set under another option, it is refused before anything starts (exit 2), as is a key that does not exist (with
the closest that do). Back to the [README](../README.md).
"""


@cache
def _written(cls: type) -> dict[str, tuple[str, str]]:
    """Field name -> (its annotation as written, such as `str | None`; the comment written for it: the comment
    lines right above the field, then the one at the end of its line), from `cls`'s source: a schema made by
    `dataclasses.make_dataclass`, which has none, reads the class it extends (a function-only runtime's)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except OSError:
        return _written(cls.__bases__[0])
    lines = source.splitlines()
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    found = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above, row = [], node.lineno - 1
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        parts = (" ".join(above), comments.get(node.lineno, ""))
        found[node.target.id] = (ast.unparse(node.annotation), " — ".join(p for p in parts if p))
    return found


def _value(value) -> str:
    if value is MISSING:
        return "(set by the option)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list | tuple):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _rows(cls: type, prefix: str) -> list[str]:
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        nested = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None
        if nested is not None:
            rows += _rows(nested, f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        # A field named by a keyword (recipe.generation.async) is not written in the source.
        kind, what = _written(cls).get(f.name) or (getattr(hints[f.name], "__name__", str(hints[f.name])),
                                                    (cls.__doc__ or "").split(". ")[0])
        what = " ".join(what.split()) + _read_by(f"{prefix}{f.name}")
        rows.append(f"| `{prefix}{f.name}` | `{_cell(kind)}` | {_cell(_value(default))} | {_cell(what)} |")
    return rows


def _read_by(key: str) -> str:
    """' (read by <group>=<options> only.)' for a key only some options of its group read (`readers.table`)."""
    group, options = readers.table().get(key, ("launcher", ()))
    if group == "launcher" or set(options) >= set(readers.options(group)):
        return ""
    return f" (read by {group}={', '.join(options)} only)"


def _options(group: str) -> str:
    return ", ".join(f"`{n}`" for n in readers.options(group))


def _table(title: str, cls: type, prefix: str, note: str = "") -> list[str]:
    return [f"## {title}", "", *([note, ""] if note else []),
            "| key | type | default | what it sets |", "|---|---|---|---|", *_rows(cls, prefix), ""]


def markdown() -> str:
    """The whole reference page."""
    out = [HEADER]
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        if f.name == "launcher":
            for name, schema in LAUNCHER_SCHEMAS.items():
                out += _table(f"launcher={name}", schema, "launcher.",
                              f"The keys of `launcher={name}` (options of the group: {_options('launcher')}).")
            continue
        if f.name == "runtime":
            for name, schema in runtimes.schemas().items():
                out += _table(f"runtime={name}", schema, "runtime.",
                              f"The keys of `runtime={name}` (options of the group: {_options('runtime')}; none "
                              "chosen: this process alone).")
            continue
        if f.name == "scheduler":
            out += _table("scheduler", SchedulerConfig, "scheduler.", f"Options of the group: {_options('scheduler')}.")
            continue
        kind = typing.get_args(hints[f.name]) or (hints[f.name],)
        schema = next((k for k in kind if dataclasses.is_dataclass(k)), None)
        if schema is None:
            out += [f"## {f.name}", "", f"`{f.name}`: {_value(f.default)} (the run directory Hydra chose).", ""]
            continue
        options = _options(f.name)
        out += _table(f.name, schema, f"{f.name}.", f"Options of the group: {options}." if options else "")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
