"""Which option of each group reads which key: one table (`table()`), made from the data alone: the options of each
group (`conf/<group>/*.yaml`), the sections' schemas (a field marked `read_by(...)` is read by those options only,
any other by every option), each launcher's own schema (a key is read by the launchers whose schema has it), and
the groups with no option chosen by default (`runtime: null`: its keys are read only once one is chosen).

With it, a key the user set (on the command line or in an experiment file: `given_keys`) that the chosen options
never read is refused before anything starts (`unread`), and a key or an option that does not exist gets the
closest that do (`unknown`). The driver's side of the config (it reads the launchers' schemas)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import typing
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

import yaml

from launchers import LAUNCHER_SCHEMAS, SchedulerConfig
from trainer.config.checks import READ_BY
from trainer.config.compose import CONF_DIR
from trainer.config.schema import SCHEMAS, Config, _kind
from trainer.errors import ConfigError
from trainjob import runtimes

EVERY = None  # a key every option of its group reads


@cache
def options(group: str) -> tuple[str, ...]:
    """The options of `group`: its conf/<group>/*.yaml."""
    folder = os.path.join(CONF_DIR, group)
    return tuple(sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))) if os.path.isdir(folder) else ()


@cache
def defaults() -> dict[str, str | None]:
    """Each group's option in conf/config.yaml's defaults list (None: the group's `null`, no option)."""
    with open(os.path.join(CONF_DIR, "config.yaml")) as f:
        entries = yaml.safe_load(f)["defaults"]
    return {k: v for e in entries if isinstance(e, dict) for k, v in e.items() if "/" not in k and " " not in k}


def _fields(schema: type, prefix: str, readers: tuple[str, ...] | None) -> dict[str, tuple[str, ...] | None]:
    """Dotted key -> the options reading it (EVERY for all) of `schema`'s fields, nested ones too; a field's
    `read_by` holds for the keys under it."""
    rows = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        marked = f.metadata.get(READ_BY, readers)
        kind = _kind(hints[f.name])
        if dataclasses.is_dataclass(kind):
            rows.update(_fields(kind, f"{prefix}{f.name}.", marked))
        rows[f"{prefix}{f.name}"] = marked
    return rows


@cache
def table() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every key of every section -> (its group, the options of the group that read it)."""
    rows: dict[str, tuple[str, tuple[str, ...]]] = {}
    schemas = {**SCHEMAS, "scheduler": SchedulerConfig}
    for group, schema in schemas.items():
        every = options(group)
        for key, readers in _fields(schema, f"{group}.", EVERY).items():
            rows[key] = (group, every if readers is EVERY else tuple(readers))
    # The launchers' and the runtimes' keys: each read by the options whose own schema has it.
    for group, own in (("launcher", LAUNCHER_SCHEMAS), ("runtime", runtimes.schemas())):
        keys: dict[str, list[str]] = {}
        for name, schema in own.items():
            for key in _fields(schema, f"{group}.", EVERY):
                keys.setdefault(key, []).append(name)
        rows.update({key: (group, tuple(names)) for key, names in keys.items()})
    return rows


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _readers_of(key: str) -> tuple[str, tuple[str, ...]] | None:
    """(group, the options reading `key`) for a key of the table, or a section of keys (`data.chat`: the options
    reading any key under it); None for a key of no section."""
    if key in table():
        return table()[key]
    under = [row for k, row in table().items() if k.startswith(key + ".")]
    if not under:
        return None
    return under[0][0], tuple(dict.fromkeys(o for _, readers in under for o in readers))


def unread(key: str, chosen: Mapping[str, str | None]) -> str | None:
    """Why the options `chosen` (group -> option, None where the group has none) never read `key`, naming the
    options that do; None where the chosen option reads it, or `key` is no section's."""
    row = _readers_of(key) if "." in key else None  # a bare group name is its option's choice, not a key
    if row is None:
        return None
    group, readers = row
    option = chosen.get(group)
    if option in readers or (option is not None and option not in options(group)):
        return None
    field = key[len(group) + 1 :]
    if option is None:
        return (
            f"no {group} is chosen ({group}: null in conf/config.yaml), and only one reads it: "
            f"add {group}={_listed(readers)}"
        )
    if not readers:
        return f"no {group} option reads it"
    verb = "does" if len(readers) == 1 else "do"
    return f"{group}={option} reads no {field}; {group}={_listed(readers)} {verb}"


def unknown(key: str) -> str | None:
    """For a `key` that is no section's: one line naming the closest keys where it goes astray (the sections, for
    a first part that is none); None where `key` exists."""
    top = [f.name for f in dataclasses.fields(Config)]
    if key in top or _readers_of(key) is not None:
        return None
    parts = key.split(".")
    depth = max(i for i in range(len(parts)) if i == 0 or _readers_of(".".join(parts[:i])) is not None)
    parent, leaf = ".".join(parts[:depth]), parts[depth]
    if not parent:
        near = difflib.get_close_matches(leaf, top, n=3, cutoff=0.6)
        hint = f"did you mean {_listed(near)}?" if near else f"the sections are {', '.join(top)}"
        return f"there is no section {leaf}; {hint}"
    siblings = sorted({k[len(parent) + 1 :].split(".")[0] for k in table() if k.startswith(parent + ".")})
    near = difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)
    hint = f"did you mean {_listed(f'{parent}.{n}' for n in near)}?" if near else f"{parent} has {', '.join(siblings)}"
    return f"{parent} has no key {leaf}; {hint}"


def unknown_option(group: str, option: str) -> str | None:
    """For an option of `group` that does not exist: one line naming the group's options (the closest first)."""
    names = options(group)
    if not names or option in names or option in ("null", "None"):
        return None
    near = difflib.get_close_matches(option, names, n=2, cutoff=0.6)
    hint = f"did you mean {_listed(f'{group}={n}' for n in near)}? " if near else ""
    return f"no such option; {hint}{group} has {', '.join(names)}"


def _parts(override: str) -> tuple[str, Any, bool]:
    """(key, value (as YAML reads it), whether it chooses a group's option) of one command-line override."""
    key, _, value = override.lstrip("+~").partition("=")
    key = key.split("@")[0]
    if key.startswith("hydra") or "/" in key:  # Hydra's own settings and groups (hydra/sweeper=optuna)
        key = "hydra." + key
    with contextlib.suppress(yaml.YAMLError):
        value = yaml.safe_load(value) if value else value
    return key, value, "." not in key and bool(options(key))


def _flat(node: object, prefix: str) -> dict[str, object]:
    if not isinstance(node, dict) or not node:
        return {prefix: node}
    return {k: v for name, child in node.items() for k, v in _flat(child, f"{prefix}.{name}").items()}


def _experiment(name: str) -> dict:
    path = os.path.join(CONF_DIR, "experiment", f"{name}.yaml")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return yaml.safe_load(f) or {}


def _overrides(args: Iterable[str]) -> list[str]:
    """The overrides of a command line (not its flags, such as `--cfg job` or `-m`)."""
    return [a for a in args if "=" in a and not a.startswith("-")]


def given_keys(args: Iterable[str]) -> dict[str, object]:
    """The keys the user set -> their values as written: those of the command line's overrides (not a group's
    option, not Hydra's own, not a deletion) and those of the experiment files they choose."""
    given: dict[str, object] = {}
    for override in _overrides(args):
        key, value, group = _parts(override)
        if group and key == "experiment":
            for name, node in _experiment(str(value)).items():
                if name != "defaults":
                    given.update(_flat(node, name))
        elif not group and not override.startswith("~") and not key.startswith("hydra."):
            given[key] = value
    return given


def chosen_by(overrides: Iterable[str]) -> dict[str, str | None]:
    """Each group's option as `overrides` choose it: conf/config.yaml's defaults, then the experiment's
    `override /<group>: <option>` entries, then the command line's `<group>=<option>`."""
    chosen = dict(defaults())
    for override in _overrides(overrides):
        key, value, group = _parts(override)
        if not group:
            continue
        if key == "experiment":
            for entry in _experiment(str(value)).get("defaults") or []:
                for k, v in entry.items() if isinstance(entry, dict) else ():
                    chosen[k.removeprefix("override ").strip("/ ")] = v
        else:
            chosen[key] = None if value in (None, "") else str(value)
    return chosen


def explain(args: Iterable[str]) -> ConfigError | None:
    """Why Hydra could not compose the command line `args`, where an override names an option that does not
    exist, a key the chosen options never read, or a key that does not exist; None where none does."""
    overrides = _overrides(args)
    chosen = chosen_by(overrides)
    for override in overrides:
        key, value, group = _parts(override)
        if group:
            reason = None if "," in str(value) else unknown_option(key, str(value))
        elif key.startswith("hydra.") or override.startswith("~"):
            continue
        else:
            reason = unread(key, chosen) or unknown(key)
        if reason:
            return ConfigError(key, value, reason)
    return None
