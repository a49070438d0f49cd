"""The line of training a run directory's `checkpoints/` holds, and its pruning.

Resuming from an earlier checkpoint than the newest starts a new line: the later checkpoints of the old one are
moved aside into `checkpoints/abandoned-<time>/` (and logged), where neither `resume=auto` nor pruning looks, and
damaged ones newer than the newest whole one into `checkpoints/damaged-<time>/`. So along the directory's
`step-<N>` folders a higher step is always a newer checkpoint, and `prune` keeps the newest of this line. A line
that began at an explicit `train.resume` records where (`record_branch`), so that a restart goes on along it."""

from __future__ import annotations

import json
import logging
import os
import time

from trainer.checkpoint import fs, layout
from trainer.checkpoint.checks import damage

log = logging.getLogger(__name__)
BRANCH_FILE = ".branch"


def latest(root: str) -> str | None:
    """The newest complete checkpoint under `root` that can be loaded, or None; each newer one that cannot
    (a file that is not as written, a garbage .metadata, a truncated shard) is passed over with a warning that
    says why."""
    for _, path in reversed(layout.steps(root)):
        problem = damage(path)
        if problem is None:
            return path
        log.warning("checkpoint %s cannot be loaded (%s): resuming from an earlier one", path, problem)
    return None


def _move_aside(root: str, kind: str, paths: list[str]) -> str:
    """Move checkpoints `paths` of `root` into a new `root/<kind>-<time>-<unique>/` (two within one second must
    not collide); that folder."""
    aside = fs.unique_dir(root, time.strftime(f"{kind}-%Y%m%d-%H%M%S-", time.gmtime()))
    for path in paths:
        fs.rename(path, os.path.join(aside, os.path.basename(path)))
    return aside


def set_aside_damaged(root: str) -> None:
    """Move each checkpoint of `root` newer than its newest whole one into `root/damaged-<time>/` (never
    deleted: a user may want to look at it), so that resume and pruning no longer meet it; a warning for each
    says why."""
    damaged = []
    for _, path in reversed(layout.steps(root)):
        problem = damage(path)
        if problem is None:
            break
        damaged.append((path, problem))
    if not damaged:
        return
    aside = _move_aside(root, "damaged", [path for path, _ in damaged])
    for path, problem in damaged:
        log.warning("checkpoint %s is damaged (%s): moved to %s; resuming from an earlier one", path, problem, aside)


def set_aside_later(root: str, start: str) -> None:
    """Resuming from `start` continues the line it is on: move the checkpoints of `root` that are not on
    it (those after `start` when it is in `root`, else all) into `root/abandoned-<time>/`, and say so."""
    start = fs.real(start)
    step = layout.step_of(start)
    from_step = step if step is not None and os.path.dirname(start) == fs.real(root).rstrip("/") else -1
    later = [path for n, path in layout.steps(root) if n > from_step]
    if not later:
        return
    aside = _move_aside(root, "abandoned", later)
    names = [os.path.basename(p) for p in later]
    log.warning("resuming from %s starts a new line: %s, of the line it leaves, moved to %s "
                "(resume=auto and pruning no longer see them; delete them yourself when not needed)",
                start, ", ".join(names), aside)


def prune(root: str, keep_latest_k: int) -> None:
    """Delete all but the newest `keep_latest_k` checkpoints of `root` (one line per directory: the lowest steps
    are the oldest)."""
    for _, old in layout.steps(root)[:-keep_latest_k]:
        fs.rmtree(old)


def record_branch(root: str, start: str) -> None:
    """Note in `root` that this run's line starts at checkpoint `start` (an explicit train.resume), so that a
    restart with the same config goes on along the line instead of branching again."""
    fs.makedirs(root)
    with fs.open(os.path.join(root, BRANCH_FILE), "w") as f:
        json.dump({"from": fs.real(start)}, f)


def branched_from(root: str) -> str | None:
    """The checkpoint this run's line started from (see `record_branch`), or None."""
    try:
        with fs.open(os.path.join(root, BRANCH_FILE), "r") as f:
            return json.load(f)["from"]
    except (OSError, ValueError, KeyError):
        return None
